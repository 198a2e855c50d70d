"""A generation batch and its scoring: completions, rewards, advantages, per-token side inputs.

`Rollouts` holds one entry per completion (groups of `num_generations` consecutive entries share a
prompt). Stages fill it in order: generate (ids, sampling log-probs), score (rewards `[n, k]`),
advantages `[n]`, then the optional per-token inputs of the loss (old / reference log-probs, IS
weights), each a list of `[C_i]` tensors. A rollout mode of the GRPO variants may mask tokens out
of the loss (`loss_mask`: text it injected, or a thought an answer continues); the sampling
log-probs of such tokens are NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import torch

from ..rewards.registry import reward_name


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logp: list[torch.Tensor]  # [C_i] each: the engine's log-probs of its sampled tokens
    finish_reason: list[str]
    completion_texts: list[str]
    rows: list[dict]  # the dataset row of each completion's prompt
    # The rollout modes of the GRPO variants (train/rollout_modes.py): which completion tokens enter
    # the loss ([C_i] bool each; None: all) and what each entry is ("full", "cut", "thought", "answer").
    loss_mask: Optional[list[torch.Tensor]] = None
    kind: Optional[list[str]] = None
    rewards: Optional[torch.Tensor] = None  # (n, k) float64, NaN = missing
    # (n, k) float64: the rewards the advantages came from (train/shaping.py: partial credit or
    # early_exit's serial reward in the first column); None: as scored. The logged `reward` reads them.
    trained_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None  # (n,) float32
    old_logp: Optional[list[torch.Tensor]] = None
    ref_logp: Optional[list[torch.Tensor]] = None
    is_weights: Optional[list[torch.Tensor]] = None
    stats: dict = field(default_factory=dict)  # scoring counters (e.g. non-finite rewards)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: Sequence[int]) -> "Rollouts":
        """The entries `idx` (in that order) as a new Rollouts; stats are kept."""
        def pick(value):
            if value is None or isinstance(value, dict):
                return value
            if isinstance(value, torch.Tensor):
                return value[torch.as_tensor(list(idx), dtype=torch.long)]
            return [value[i] for i in idx]

        return Rollouts(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def concat(cls, parts: Sequence["Rollouts"]) -> "Rollouts":
        def join(values):
            if values[0] is None:
                return None
            if isinstance(values[0], dict):
                return {k: sum(v.get(k, 0) for v in values) for k in values[0]}
            if isinstance(values[0], torch.Tensor):
                return torch.cat(values)
            return [x for v in values for x in v]

        return cls(**{f.name: join([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def completion_lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float32)

    def trained_tokens(self, i: int) -> int:
        """Completion tokens of entry i that enter the loss."""
        return len(self.completion_ids[i]) if self.loss_mask is None else int(self.loss_mask[i].sum())


def from_engine(groups, prompt_ids: list[list[int]], rows: list[dict]) -> Rollouts:
    """Flatten the engine's groups (one list of n Completion per prompt) into a Rollouts."""
    flat = [(p, r, c) for p, r, group in zip(prompt_ids, rows, groups, strict=True) for c in group]
    return Rollouts(
        prompt_ids=[p for p, _, _ in flat],
        completion_ids=[list(c.token_ids) for _, _, c in flat],
        sampling_logp=[torch.tensor(c.logprobs, dtype=torch.float32) for _, _, c in flat],
        finish_reason=[c.finish_reason for _, _, c in flat],
        completion_texts=[c.text for _, _, c in flat],
        rows=[r for _, r, _ in flat],
    )


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------


def score(reward_funcs: Sequence[Callable], batch: Rollouts, prompt_column: str, conversational: bool) -> tuple[torch.Tensor, int]:
    """(rewards (n, k) float64, count of non-finite values): None and non-finite values become NaN (missing).

    Each function is called as TRL calls it: `f(prompts=, completions=, completion_ids=,
    **columns)` with every other dataset column as a list of one entry per completion. A function
    that raises, or returns the wrong number of values or a non-number, is an error naming it.
    The count is of values that were NaN/inf (not None): a reward function's bug, worth a metric.
    Thoughts (multi_answer) are not graded: their rows stay NaN.
    """
    if batch.kind is not None and "thought" in batch.kind:  # multi_answer: its answers are graded, not thoughts
        graded = [i for i, kind in enumerate(batch.kind) if kind != "thought"]
        rewards = torch.full((len(batch), len(reward_funcs)), math.nan, dtype=torch.float64)
        rewards[graded], non_finite = score(reward_funcs, batch.select(graded), prompt_column, conversational)
        return rewards, non_finite
    n = len(batch)
    prompts = [r[prompt_column] for r in batch.rows]
    completions = ([[{"role": "assistant", "content": t}] for t in batch.completion_texts]
                   if conversational else list(batch.completion_texts))
    columns = {key: [r.get(key) for r in batch.rows] for key in batch.rows[0] if key != prompt_column}
    rewards = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float64)
    non_finite = 0
    for j, func in enumerate(reward_funcs):
        name = reward_name(func)
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=batch.completion_ids, **columns)
        except Exception as err:
            raise RuntimeError(f"reward function {name!r} raised {type(err).__name__}: {err}") from err
        if values is None or not hasattr(values, "__len__") or len(values) != n:
            got = "None" if values is None else (f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__)
            raise ValueError(f"reward function {name!r} must return one value per completion ({n}), got {got}")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
                raise ValueError(f"reward function {name!r} returned {v!r} (type {type(v).__name__}) for completion {i}; expected a float or None")
            v = float(v)
            if math.isfinite(v):
                rewards[i, j] = v
            else:
                non_finite += 1
    return rewards, non_finite


def weighted_rewards(rewards: torch.Tensor, weights: Optional[Sequence[float]]) -> torch.Tensor:
    """(n,) weighted sum over functions ignoring missing values; NaN where every value is missing (TRL)."""
    w = torch.ones(rewards.shape[1], dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    total = torch.nansum(rewards * w, dim=1)
    return torch.where(rewards.isnan().all(dim=1), torch.nan, total)


def zero_std_groups(rewards: torch.Tensor, weights, num_generations: int) -> torch.Tensor:
    """(G,) bool: groups whose known weighted rewards all agree (no learning signal)."""
    total = weighted_rewards(rewards, weights).view(-1, num_generations)
    known = ~total.isnan()
    lo = torch.where(known, total, math.inf).min(dim=1).values
    hi = torch.where(known, total, -math.inf).max(dim=1).values
    return ~(hi - lo > 1e-9)


# ----------------------------------------------------------------------------------------------
# Importance-sampling correction (TRL's vllm_importance_sampling_* semantics)
# ----------------------------------------------------------------------------------------------


def importance_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, *, mode: str, cap: float,
                       clip_min: Optional[float]) -> torch.Tensor:
    """IS weights `[C]` of one completion: exp(trainer - sampler) per token (token_*) or per sequence
    (sequence_*, the summed difference, broadcast), truncated into [clip_min, cap] or zeroed outside.
    Tokens without a sampling log-prob (NaN: not trained) add nothing to a sequence's sum."""
    diff = torch.nan_to_num(old_logp.float() - sampling_logp.float(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum().expand_as(diff)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=cap)
    lo = -math.inf if clip_min is None else clip_min
    return ratio.masked_fill((ratio < lo) | (ratio > cap), 0.0)

"""The score stage: reward functions -> rewards `[n, k]`, the groups without signal, and TRL's per-step
reward metrics (what is logged is what trained: `trained_rewards` where shaping replaced them)."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ..rewards.registry import reward_name
from .batch import Rollouts


def conversational(prompt) -> bool:
    """Whether a dataset prompt is a chat (a list of messages) rather than plain text."""
    return isinstance(prompt, list)




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


def weighted_mean(rewards: torch.Tensor, weights) -> float:
    total = weighted_rewards(rewards, weights)
    known = total[~total.isnan()]
    return known.mean().item() if known.numel() else float("nan")


def reward_metrics(batch: Rollouts, reward_funcs: Sequence[Callable], options) -> dict:
    """TRL's per-step reward and completion metrics for the completions of one step. `reward`,
    `reward_std` and `frac_reward_zero_std_step` are of the rewards the advantages came from
    (`batch.trained_rewards`: partial credit, early_exit's serial reward), `rewards/<func>/*` of each
    function's values as scored. Means and stds over values are `Pooled`: on many ranks they are of
    all ranks' values (metrics.py). options: the advantages stage's (`advantages.AdvantageOptions`)."""
    from ..metrics import Pooled

    G = options.group_size
    trained = batch.rewards if batch.trained_rewards is None else batch.trained_rewards
    total = weighted_rewards(trained, options.reward_weights)
    groups = total.view(-1, G)
    group_std = torch.stack([g[~g.isnan()].std() if (~g.isnan()).sum() > 1 else g.new_zeros(()) for g in groups])
    lengths = batch.completion_lengths()
    clipped = torch.tensor([r == "length" for r in batch.finish_reason], dtype=torch.float32)
    m = {
        "reward": Pooled.of(total),
        "reward_std": Pooled.of(group_std),  # the mean of the groups' stds
        "frac_reward_zero_std_step": Pooled.of(zero_std_groups(trained, options.reward_weights, G).double()),
        "completions/mean_length": Pooled.of(lengths),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": Pooled.of(clipped),
        "advantages/abs_mean": Pooled.of(batch.advantages.abs()),
    }
    for j, f in enumerate(reward_funcs):
        m[f"rewards/{reward_name(f)}/mean"] = Pooled.of(batch.rewards[:, j])
        m[f"rewards/{reward_name(f)}/std"] = Pooled.of(batch.rewards[:, j], "std")
    return m

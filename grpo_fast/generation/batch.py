"""The generation batch: completions, rewards, advantages, per-token side inputs, one entry per completion.

`Rollouts` holds one entry per completion (groups of `num_generations` consecutive entries share a
prompt). Each stage returns what it computed and the loop makes the next batch from it (`dataclasses.replace`): generate (ids, sampling log-probs), score (rewards `[n, k]`),
advantages `[n]`, then the optional per-token inputs of the loss (old / reference log-probs, IS
weights), each a list of `[C_i]` tensors. A rollout mode of the GRPO variants may mask tokens out
of the loss (`loss_mask`: text it injected, or a thought an answer continues); the sampling
log-probs of such tokens are NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logp: list[torch.Tensor]  # [C_i] each: the engine's log-probs of its sampled tokens
    finish_reason: list[str]
    completion_texts: list[str]
    rows: list[dict]  # the dataset row of each completion's prompt
    # The rollout modes of the GRPO variants (generation/modes/early_exit.py, multi_answer.py): which completion tokens enter
    # the loss ([C_i] bool each; None: all) and what each entry is ("full", "cut", "thought", "answer").
    loss_mask: Optional[list[torch.Tensor]] = None
    kind: Optional[list[str]] = None
    rewards: Optional[torch.Tensor] = None  # (n, k) float64, NaN = missing
    # (n, k) float64: the rewards the advantages came from (the rollout mode's advantages: partial credit or
    # early_exit's serial reward in the first column); None: as scored. The logged `reward` reads them.
    trained_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None  # (n,) float32
    old_logp: Optional[list[torch.Tensor]] = None
    ref_logp: Optional[list[torch.Tensor]] = None
    is_weights: Optional[list[torch.Tensor]] = None
    stats: dict = field(default_factory=dict)  # scoring counters (e.g. non-finite rewards)
    # multi_turn (grpo_fast/generation/agents): each completion as messages, the assistant turns and the tool results
    # (what conversational reward functions receive); None: the completion is one assistant message
    messages: Optional[list[list[dict]]] = None
    environments: Optional[list] = None  # multi_turn with environment_factory: each completion's environment
    # routing replay (models/routing.py): the experts the engine routed each completion token's step to,
    # [C_i, num_hidden_layers, top_k] int16 each (row t: the position predicting token t); None: not recorded
    routed_experts: Optional[list[torch.Tensor]] = None
    # truncated sampling (generation/truncation.py): each completion token's kept set, where the engine returned
    # them or the old policy's pass rebuilt them (`KeptTokens` each); None: no truncation, or not rebuilt yet
    kept: Optional[list] = None
    # vision-language prompts (models/vision.py): each completion's prompt's image processor outputs (a mapping:
    # pixel_values, image_grid_thw, ...; the prompt ids hold the expanded image tokens), one object shared by the G
    # completions of a group, so that the trainer encodes a prompt's images once; None: a text-only batch (an entry's
    # None: a text-only prompt)
    image_inputs: Optional[list] = None

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
        def join(name, values):
            if values[0] is None or (name == "kept" and any(v is None for v in values)):
                return None  # (kept sets that some parts lack: the trainer rebuilds them all)
            if isinstance(values[0], dict):
                return {k: sum(v.get(k, 0) for v in values) for k in values[0]}
            if isinstance(values[0], torch.Tensor):
                return torch.cat(values)
            return [x for v in values for x in v]

        return cls(**{f.name: join(f.name, [getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def completion_lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float32)

    def model_lengths(self) -> torch.Tensor:
        """Completion tokens the model sampled: a trajectory's (kind "trajectory": multi_turn) leave out the tool
        results and the template's tokens between turns, its loss mask; the other entries' are all theirs."""
        kinds = self.kind or [None] * len(self)
        return torch.tensor([float(self.loss_mask[i].sum()) if k == "trajectory" else float(len(c))
                             for i, (k, c) in enumerate(zip(kinds, self.completion_ids, strict=True))])

    def trained_tokens(self, i: int) -> int:
        """Completion tokens of entry i that enter the loss."""
        return len(self.completion_ids[i]) if self.loss_mask is None else int(self.loss_mask[i].sum())


class Entries:
    """A `Rollouts` built one trained sequence at a time, with its loss mask and kind (the rollout modes that
    mask tokens a sequence did not sample itself: early_exit's injected text, multi_answer's thought)."""

    COLUMNS = ("prompt_ids", "rows", "completion_ids", "sampling_logp", "loss_mask", "finish_reason",
               "completion_texts", "kind")

    def __init__(self):
        self.columns: dict = {k: [] for k in self.COLUMNS}

    def add(self, prompt, row, ids, logp, mask, reason, text, kind) -> None:
        """One entry: its prompt and row, completion ids, sampling log-probs (NaN where masked), loss mask,
        finish reason, graded text and kind."""
        c = self.columns
        c["prompt_ids"].append(prompt)
        c["rows"].append(row)
        c["completion_ids"].append(list(ids))
        c["sampling_logp"].append(torch.tensor(logp, dtype=torch.float32))
        c["loss_mask"].append(torch.tensor(mask, dtype=torch.bool))
        c["finish_reason"].append(reason)
        c["completion_texts"].append(text)
        c["kind"].append(kind)

    def rollouts(self) -> Rollouts:
        return Rollouts(**self.columns)


def from_engine(groups, prompt_ids: list[list[int]], rows: list[dict]) -> Rollouts:
    """Flatten the engine's groups (one list of n Completion per prompt) into a Rollouts (with their routing
    records, and their kept sets, when every completion carries them; with their prompts' image inputs where any
    prompt has images)."""
    flat = [(p, r, c) for p, r, group in zip(prompt_ids, rows, groups, strict=True) for c in group]
    routed = [c.routed_experts for _, _, c in flat]
    kept = [c.kept for _, _, c in flat]
    images = [c.image_inputs for _, _, c in flat]  # (one dict per prompt, shared by its group's completions)
    return Rollouts(
        prompt_ids=[p for p, _, _ in flat],
        completion_ids=[list(c.token_ids) for _, _, c in flat],
        sampling_logp=[torch.tensor(c.logprobs, dtype=torch.float32) for _, _, c in flat],
        finish_reason=[c.finish_reason for _, _, c in flat],
        completion_texts=[c.text for _, _, c in flat],
        rows=[r for _, r, _ in flat],
        routed_experts=routed if flat and all(x is not None for x in routed) else None,
        kept=kept if flat and all(x is not None for x in kept) else None,
        image_inputs=images if any(x is not None for x in images) else None,
    )

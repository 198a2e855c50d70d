"""Token-budget micro-batches: sequences packed end to end into one row, no compute on padding.

One sample is `prompt_ids + completion_ids`. Its completion token k is predicted by the hidden
state one position earlier, so the packed row holds `prompt + completion[:-1]` (the last
completion token is a target only) and positions restart at 0 for every sequence.

Restarting `position_ids` alone does not keep packed sequences apart under SDPA or eager attention
(measured: up to 4.5 difference on a tiny Llama; tests/trainer/test_packing.py). How they are kept apart (`attention`):
- "varlen": flash-attention 2; transformers runs the varlen kernel from the restarting position ids.
- "packed": the row carries `cu_seq_lens` (where each sequence starts) and the model attends with
  grpo_fast's per-sequence SDPA (`grpo_fast/train/attention.py`): no mask, n * longest^2 work.
- "mask": any other model; the row gets a dense block-diagonal causal mask `[1, 1, L, L]` (bool,
  True = may attend), O(L^2) in memory and work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

ATTENTION_MODES = ("mask", "varlen", "packed")


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices so each group's total length is <= max_tokens (first-fit decreasing).

    lengths: tokens each sample occupies in a packed row (0: the sample is left out, it has no
    completion token to train on). Returns lists of indices into `lengths`, each sorted ascending.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens, more than the micro-batch budget max_tokens={max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def plan_group_micro_batches(lengths: Sequence[int], keys: Sequence, max_tokens: int) -> list[list[int]]:
    """`plan_micro_batches` with the samples that share a key (a VLM prompt's G completions: `keys[i]`, None for a
    sample of its own) kept in one micro-batch wherever they fit, so that a prompt's images are encoded once per
    step, not once per micro-batch its completions landed in. First-fit decreasing over whole groups; a group longer
    than the budget is cut by `plan_micro_batches` into pieces that are placed the same way."""
    plan_micro_batches(lengths, max_tokens)  # (its checks: the budget, no sample longer than it)
    groups: dict = {}
    for i, n in enumerate(lengths):
        if n > 0:
            groups.setdefault(("own", i) if keys[i] is None else ("key", keys[i]), []).append(i)
    units = []
    for members in groups.values():
        if sum(lengths[i] for i in members) <= max_tokens:
            units.append(members)
        else:
            pieces = plan_micro_batches([lengths[i] if i in members else 0 for i in range(len(lengths))], max_tokens)
            units.extend(pieces)
    bins: list[list[int]] = []
    room: list[int] = []
    for unit in sorted(units, key=lambda u: (-sum(lengths[i] for i in u), u[0])):
        size = sum(lengths[i] for i in unit)
        for b, free in enumerate(room):
            if size <= free:
                bins[b].extend(unit)
                room[b] -= size
                break
        else:
            bins.append(list(unit))
            room.append(max_tokens - size)
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    """One packed forward. `b` sequences, `L` packed tokens, `Tc` the longest completion.

    input_ids, position_ids: (1, L) long; cu_seq_lens: (b + 1,) int32, where each sequence starts
    in the row (L last); attention: how the forward keeps sequences apart (module docstring);
    attention_mask: (1, 1, L, L) bool with attention="mask", else None;
    hidden_index: (b, Tc) long, the packed position whose hidden state predicts completion token t
    (0 where t is past the completion); target_ids: (b, Tc) long; completion_mask: (b, Tc) bool.
    rows: which samples of the caller's list the b sequences are. routing: the engine's routing of the completion
    tokens (`models.routing.Replay`: routing replay), set by the Packer; None: the model routes them itself.
    kept: the kept sets of truncated sampling over the (b, Tc) positions (`objective.KeptSets`, row-major), set by
    the Packer or rebuilt by the step's forward; None: every position over the whole vocabulary.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    attention: str
    attention_mask: Optional[torch.Tensor]
    hidden_index: torch.Tensor
    target_ids: torch.Tensor
    completion_mask: torch.Tensor
    rows: list[int]
    routing: Optional[object] = None
    kept: Optional[object] = None
    images: Optional[object] = None  # a VLM's images of the row (`models.vision.RowImages`), set by the Packer

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.attention == "mask":
            inputs["attention_mask"] = self.attention_mask
        elif self.attention == "packed":
            inputs["cu_seq_lens_q"] = self.cu_seq_lens  # reaches the attention function as a keyword
        return inputs

    def pad(self, per_sample: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Per-sample completion values (each [C_i], for the samples in `rows`) -> (b, Tc) float32."""
        out = torch.full(self.target_ids.shape, fill, dtype=torch.float32)
        for j, i in enumerate(self.rows):
            values = per_sample[i]
            out[j, : values.shape[0]] = values.float().cpu()
        return out.to(self.target_ids.device)

    def unpad(self, values: torch.Tensor) -> list[torch.Tensor]:
        """(b, Tc) -> one [C_i] tensor per sequence, in `rows` order."""
        lengths = self.completion_mask.sum(dim=1).tolist()
        return [values[j, :n] for j, n in enumerate(lengths)]


def block_causal_mask(lengths: Sequence[int], device=None) -> torch.Tensor:
    """(1, 1, L, L) bool: position q may attend to k iff both lie in one sequence and k <= q."""
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device))
    same = seq_id[:, None] == seq_id[None, :]
    return torch.tril(same)[None, None]


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    rows: Sequence[int],
    *,
    device=None,
    attention: str = "mask",
) -> PackedMicroBatch:
    """Pack samples `rows` (each with a non-empty completion) into one row; see `PackedMicroBatch`."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    ids, positions, lengths, index_rows, targets = [], [], [], [], []
    offset = 0
    for i in rows:
        prompt, completion = list(prompt_ids[i]), list(completion_ids[i])
        if not completion:
            raise ValueError(f"sample {i} has an empty completion: nothing to pack (leave it out of the plan)")
        seq = prompt + completion[:-1]
        ids += seq
        positions += range(len(seq))
        lengths.append(len(seq))
        start = offset + len(prompt) - 1  # hidden state predicting completion[0]
        index_rows.append(list(range(start, start + len(completion))))
        targets.append(completion)
        offset += len(seq)
    width = max(len(t) for t in targets)
    hidden_index = torch.zeros(len(rows), width, dtype=torch.long)
    target_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for j, (idx, tgt) in enumerate(zip(index_rows, targets, strict=True)):
        hidden_index[j, : len(idx)] = torch.tensor(idx)
        target_ids[j, : len(tgt)] = torch.tensor(tgt)
        mask[j, : len(tgt)] = True
    return PackedMicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        cu_seq_lens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
        attention=attention,
        attention_mask=block_causal_mask(lengths, device) if attention == "mask" else None,
        hidden_index=hidden_index.to(device),
        target_ids=target_ids.to(device),
        completion_mask=mask.to(device),
        rows=list(rows),
    )

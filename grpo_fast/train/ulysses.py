"""Ulysses attention: a packed row split over the N ranks of a sequence-parallel group attends as a whole.

Each rank holds a contiguous 1/N of the row (`S` tokens) and runs every layer on it; only attention needs
the whole row. Around it, one all-to-all per tensor trades the split: q, k and v go from [1, H, S, d] (all
heads, my tokens) to [1, H/N, N*S, d] (my heads, every token), the attention of the packed trainer runs on
that with the row's sequence boundaries (they are global: the row's `cu_seq_lens`, or its block-diagonal
mask), and its output goes back to [1, S, H, d]. Every other layer is per token, so nothing else moves.
(DeepSpeed-Ulysses, Jacobs et al. 2023; verl's `ulysses_sequence_parallel_size`.)

The inner attention is the one the packed trainer would use (`train/packing.py`): "packed", grpo_fast's
per-sequence SDPA (`train/attention.py`); "mask", the model's own attention function with the dense
block-diagonal mask (soft-capping models); "varlen", flash-attention's varlen kernel from the row's
`cu_seq_lens` — written, NOT tested (no flash-attn, and one GPU, where this is built; README says so).

The head rule (checked before any work, `check_heads`): query heads % N == 0, and KV heads % N == 0 or
N % KV heads == 0; in the second case each KV head is repeated N / KV heads times before the scatter, so each
rank gets the one its query heads read (as verl does).

The swap of the model's attention is a context (`attending`) that the caller holds over the forward AND the
backward of a micro-batch: under gradient checkpointing the layers' recompute runs in the backward and must
attend the same way. Bytes moved are counted (`BYTES`), for the benchmark's formula check.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..compat import attention_implementation, set_attention_implementation

NAME = "grpo_fast_ulysses"
BYTES = {"sent": 0}  # bytes this rank sent to others in all-to-alls (its own chunk stays): the benchmark reads it


def working_sizes(heads: int, kv_heads: int, limit: Optional[int] = None) -> list[int]:
    """The sequence_parallel_size values the head rule allows for a model (up to `limit`, default its query heads)."""
    return [n for n in range(1, (limit or heads) + 1)
            if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]


def head_counts(model_config) -> tuple[int, int]:
    """(query heads, KV heads) of a transformers model config."""
    heads = model_config.num_attention_heads
    return heads, getattr(model_config, "num_key_value_heads", None) or heads


def check_heads(model_config, n: int) -> None:
    """Refuse, in one line, a sequence_parallel_size the model's heads cannot be scattered over."""
    heads, kv = head_counts(model_config)
    if n > 1 and n not in working_sizes(heads, kv, max(n, heads)):
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid for this model ({heads} query heads, {kv} "
                         f"KV heads): Ulysses scatters heads over the N ranks, so it needs query heads % N == 0 and "
                         f"KV heads % N == 0 or N % KV heads == 0; sizes that work: "
                         f"{', '.join(map(str, working_sizes(heads, kv)))}")


def check_heads_of_folder(path: str, n: int) -> None:
    """`check_heads` from a model folder's config.json alone (the launcher's check before any rank starts)."""
    import json
    import os
    from types import SimpleNamespace

    with open(os.path.join(path, "config.json")) as f:
        values = json.load(f)
    values = values.get("text_config", values)  # (a vision-language model's language part; refused later anyway)
    if "num_attention_heads" in values:
        check_heads(SimpleNamespace(**{k: values.get(k) for k in ("num_attention_heads", "num_key_value_heads")}), n)


class _AllToAll(torch.autograd.Function):
    """x split into N chunks along `scatter`, chunk j sent to rank j; the N chunks received concatenated along
    `gather` in rank order. Its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """One flat buffer each way (all_to_all_single: gloo's list form stages its own flat copies, 24 MB a rank at
    2k tokens of the benchmark's model): chunk j of `scatter` as the j-th block, the blocks received from ranks
    0..N-1 laid side by side along `gather`."""
    n = dist.get_world_size(group)
    blocks = x.movedim(scatter, 0)
    send = blocks.reshape(n, blocks.shape[0] // n, *blocks.shape[1:]).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    BYTES["sent"] += send.numel() * send.element_size() * (n - 1) // n
    parts = received.movedim(1, scatter + 1).movedim(0, gather)  # [..., N, gather's size, ...]
    return parts.reshape(*parts.shape[:gather], -1, *parts.shape[gather + 2:])


def all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """Differentiable all-to-all over `group` (see `_AllToAll`)."""
    return _AllToAll.apply(x, group, scatter, gather)


@dataclass(frozen=True)
class _Active:
    group: object  # the sequence-parallel process group
    inner: str  # "packed", "mask" or "varlen" (module docstring)
    previous: str  # the model's own attention implementation (the "mask" path calls it)


_active: Optional[_Active] = None


@contextlib.contextmanager
def attending(model, group, inner: str):
    """Within the block (forward and backward of a sharded micro-batch), `model` attends through Ulysses."""
    from transformers import AttentionInterface

    global _active
    AttentionInterface.register(NAME, ulysses_attention_forward)
    previous = attention_implementation(model.config)
    outer, _active = _active, _Active(group, inner, previous)
    set_attention_implementation(model.config, NAME)
    try:
        yield
    finally:
        set_attention_implementation(model.config, previous)
        _active = outer


class _Module:
    """The attention module as the inner function sees it after the scatter: its own attributes, but each rank's
    query heads per KV head where the KV heads were repeated to N (transformers' sdpa / eager repeat by it)."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """query [1, Hq, S, d], key / value [1, Hkv, S, d] (this rank's tokens) -> ([1, S, Hq, d], None)."""
    active = _active
    if active is None:
        raise RuntimeError("Ulysses attention called outside `ulysses.attending` (a sharded micro-batch's forward "
                           "and backward run inside it)")
    group = active.group
    n = dist.get_world_size(group)
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("sequence parallelism: attention sinks are per head and read whole by the model's "
                                  "attention; scattering heads over ranks would need them sliced (not implemented)")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads < n:  # N % KV heads == 0 (check_heads): each rank gets one copy of the KV head its query heads read
        key, value = (x.repeat_interleave(n // kv_heads, dim=1) for x in (key, value))
    q, k, v = (all_to_all(x, group, scatter=1, gather=2) for x in (query, key, value))  # [1, H/N, N*S, d]
    local = _Module(module, q.shape[1] // k.shape[1])
    if active.inner == "packed":
        from .attention import packed_sdpa_forward

        out, _ = packed_sdpa_forward(local, q, k, v, None, **kwargs)
    elif active.inner == "varlen":  # UNTESTED: flash-attention's varlen kernel over the row's sequences
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        starts = kwargs.pop("cu_seq_lens_q")
        longest = int((starts[1:] - starts[:-1]).max())
        out, _ = ALL_ATTENTION_FUNCTIONS[active.previous](local, q, k, v, None, cu_seq_lens_q=starts, cu_seq_lens_k=starts,
                                                          max_length_q=longest, max_length_k=longest, **kwargs)
    else:  # "mask": the model's own attention with the row's whole block-diagonal mask
        out, _ = _model_attention(module, active.previous)(local, q, k, v, attention_mask, **kwargs)
    assert out.shape[2] * n == heads, (out.shape, heads)
    return all_to_all(out, group, scatter=1, gather=2), None  # [1, N*S, H/N, d] -> [1, S, H, d]


def _model_attention(module, name: str):
    """The attention function `name` of transformers' interface; "eager" is the modeling file's own function (it
    applies the model's soft-cap and the like)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return inspect.getmodule(type(module)).eager_attention_forward

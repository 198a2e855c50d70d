"""`linear_topk`: each token's k largest logits (after the model's logit map and the temperature), their
ids and the full-vocabulary log-sum-exp, from hidden states and the lm_head weight, never holding the
`[tokens x vocab]` logits.

What it is for: vLLM samples from `z = LogitMap(h W^T + b)` truncated by min_p, top-k and top-p; where the
engine cannot return the kept set, the trainer rebuilds it from the old policy's logits, and every rule
vLLM applies (min_p against the max, top-k, top-p over the sorted probabilities) only ever keeps tokens
among the largest logits. So the k largest, with the full lse (the probabilities' denominator), are enough
to replay them for any kept set of at most k tokens.

The pass is the forward's chunk loop (grpo_fast/ops/row_ops.py): per chunk of C tokens one `[C, V]` slab of
logits (a matmul, bounded by the slab budget), then per row the top k and the lse, so memory is O(C V + N k).
`cpu`: one C++ pass per row (its lse, target logit and top k: block maxima, a floor under the k-th, the
few candidates above it sorted; csrc/row_ops.cpp); `torch`, and `triton` on CUDA (there is no dedicated
Triton kernel: cuBLAS and torch.topk do the slab): torch.topk per slab, ties then put in order.

Order and ties: values descending, equal values by lower id first; which of several equal values at the
k-th place are kept follows the same rule (the lowest ids). `torch.topk` leaves the order of ties
unspecified, and vLLM's top-k keeps every logit equal to the k-th (`count_ge` says how many there are).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..objective import LogitMap
from . import chunk_driver, row_ops
from .linear_logprobs import check_targets, validate_linear

# On a GPU (the `triton` backend: cuBLAS slabs, torch.topk) a chunk's logit slab may take 1/128 of the memory:
# 1.1 GB on an H200 (3600 rows at V = 151936 in bf16), ~5x that at the peak with the float32 temporaries of
# torch.topk and the row statistics. The CPU backends keep the forward's slab budget (row_ops.SLAB_BYTES).
CUDA_MEMORY_FRACTION = 128


class LinearTopK(NamedTuple):
    values: Tensor  # [..., k] float32: the k largest mapped logits z, descending (ties: lower id first)
    ids: Tensor  # [..., k] int64: their token ids
    lse: Tensor  # [...] float32: logsumexp of z over the whole vocabulary
    count_ge: Tensor  # [...] int64: how many logits are >= values[..., -1] (k, or more where the k-th value ties)
    target_logit: Optional[Tensor]  # [...] float32: z of target_ids, when they were given


def linear_topk(hidden: Tensor, weight: Tensor, target_ids: Optional[Tensor] = None, *, bias: Optional[Tensor] = None,
                temperature: float = 1.0, logit_scale: float = 1.0, logit_softcap: Optional[float] = None, k: int,
                backend: str = "auto") -> LinearTopK:
    """Each token's k largest logits `z = LogitMap(temperature, logit_scale, logit_softcap)(hidden @ weight.T + bias)`
    with their ids, the full-vocabulary lse and (with target_ids) the target's z; no gradient.

    hidden `[..., H]`, weight `[V, H]` (same floating dtype, contiguous), bias `[V]` or None, target_ids `[...]`
    integer in [0, V) or None, 1 <= k <= V. backend: "auto", "cpu", "torch" or "triton" (on CUDA: cuBLAS slabs
    and torch.topk). Returns a `LinearTopK` (fields above); values and lse in float32.
    """
    logit_map = LogitMap(float(temperature), float(logit_scale), None if logit_softcap is None else float(logit_softcap))
    probe = target_ids if target_ids is not None else torch.zeros(hidden.shape[:-1], dtype=torch.int64, device=hidden.device)
    backend = validate_linear(hidden, weight, probe, bias, backend)
    vocab = weight.shape[0]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an integer in [1, {vocab}] (the vocabulary of weight), got {k!r}")
    lead = tuple(hidden.shape[:-1])
    hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    target = None if target_ids is None else target_ids.reshape(-1).to(torch.int64)
    if target is not None:
        check_targets(target, vocab)
    with torch.no_grad():
        out = _chunk_loop(hidden, weight, bias, target, logit_map, k, backend)
    values, ids, lse, count_ge, target_logit = out
    return LinearTopK(values.view(*lead, k), ids.view(*lead, k), lse.view(lead), count_ge.view(lead),
                      None if target_logit is None else target_logit.view(lead))


def _chunk_loop(hidden, weight, bias, target, logit_map, k, backend):
    n, vocab = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    values, lse = torch.empty(n, k, **f32), torch.empty(n, **f32)
    ids, count_ge = (torch.empty(s, dtype=torch.int64, device=hidden.device) for s in ((n, k), n))
    target_logit = None if target is None else torch.empty(n, **f32)
    if backend == "cpu":
        from . import cpu

        row_ops_, rows_topk = cpu.ROW_OPS, cpu.row_topk
    else:
        row_ops_, rows_topk = row_ops.TORCH_ROW_OPS, functools.partial(torch_row_topk, row_ops=row_ops.TORCH_ROW_OPS)
    if hidden.device.type == "cuda":  # the slab and its ~4 float32 temporaries within a few % of the GPU's memory
        budget = torch.cuda.get_device_properties(hidden.device).total_memory // CUDA_MEMORY_FRACTION
        step, spans = chunk_driver.plan(n, vocab, weight.element_size(), budget=budget, min_rows=row_ops.MIN_ROWS,
                                        balanced=True)
    else:
        step, spans = row_ops._plan(n, vocab, None, weight.element_size())
    slab = weight.new_empty(step, vocab) if n else None
    for s, e in spans:
        logits = row_ops._logits(slab, hidden[s:e], weight, bias, row_ops_)
        values[s:e], ids[s:e], count_ge[s:e], lse[s:e], target_c = rows_topk(
            logits, k, logit_map, None if target is None else target[s:e])
        if target is not None:
            target_logit[s:e] = target_c
    return values, ids, lse, count_ge, target_logit


def torch_row_topk(logits: Tensor, k: int, logit_map: LogitMap, target: Optional[Tensor] = None, *, row_ops):
    """(values [C, k] f32, ids [C, k] int64, count_ge [C] int64, lse [C] f32, target_logit [C] f32 or None) of
    z = logit_map(logits [C, V]), in the order of the module docstring: torch.topk, then ties put in order
    (and, where the k-th value ties beyond k, the kept ones chosen by lowest id)."""
    probe = target if target is not None else torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    logp, _, lse = row_ops.stats(logits, probe, logit_map)
    target_logit = None if target is None else logp + lse
    z = logit_map(logits.float())
    values, ids = torch.topk(z, k, dim=-1)
    kth = values[:, -1:]
    count_ge = (z >= kth).sum(-1)
    over = (count_ge > k).nonzero().squeeze(-1)
    if over.numel():  # more logits equal the k-th than places left: the lowest ids among them
        zo, kth_o = z[over], kth[over]
        greater = zo > kth_o
        tied = (zo == kth_o) & ((zo == kth_o).cumsum(-1) <= k - greater.sum(-1, keepdim=True))
        ids[over] = (greater | tied).nonzero()[:, 1].view(-1, k)
        values[over] = zo.gather(-1, ids[over])
    by_id = ids.sort(dim=-1).indices  # ids ascending, then a stable sort by value: ties by lower id
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order), count_ge, lse, target_logit


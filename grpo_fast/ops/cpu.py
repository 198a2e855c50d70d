"""The `cpu` backend: the row passes of the chunk loop in C++ (`grpo_fast._C`, see csrc/).

The C++ passes take float32 or bfloat16 logit slabs by pointer; this file only checks layouts,
allocates the per-row outputs and passes pointers.
"""

from __future__ import annotations

import functools

import torch

from . import kept
from .kept import KeptChunk, KeptGrads, KeptOps
from .row_ops import RowOps

_DTYPE_BITS = {torch.float32: 32, torch.bfloat16: 16}


@functools.lru_cache(maxsize=None)
def _native():
    try:
        from grpo_fast import _C
    except ImportError as err:
        raise ImportError(
            "backend='cpu' needs the native extension grpo_fast._C, which was not built; reinstall "
            "with `pip install --no-build-isolation -e .` (or use backend='torch')"
        ) from err
    return _C


def _slab(logits: torch.Tensor) -> torch.Tensor:
    assert logits.dim() == 2 and logits.device.type == "cpu", (logits.shape, logits.device)
    if logits.dtype not in _DTYPE_BITS:  # float16 slabs: the passes run in float32
        logits = logits.float()
    return logits.contiguous()


def _map(logit_map):
    """The C++ passes' (pre, post, softcap) of an `objective.LogitMap`."""
    return float(logit_map.pre), float(logit_map.post), logit_map.softcap is not None


def _stats(logits, target, logit_map):
    """(logp, entropy, lse), each [C] float32, of the rows of `logit_map(logits [C, V])`."""
    logits = _slab(logits)
    c, v = logits.shape
    logp, entropy, lse = (torch.empty(c, dtype=torch.float32) for _ in range(3))
    target = target.to(torch.int64).contiguous()
    _native().row_stats(logits.data_ptr(), _DTYPE_BITS[logits.dtype], target.data_ptr(), c, v, *_map(logit_map),
                        logp.data_ptr(), entropy.data_ptr(), lse.data_ptr())
    return logp, entropy, lse


def _grad_(logits, target, lse, g, logit_map, g_entropy=None, entropy=None):
    """In place: `logits [C, V] <- [g (onehot(target) - p) - g_entropy p (log p + H)] dz/dx`,
    p = softmax(z), z = logit_map(logits) (dz/dx = 1 / T for a bare temperature), H = entropy
    (g_entropy and entropy [C] or both None); returns logits."""
    assert logits.is_contiguous() and logits.dtype in _DTYPE_BITS, (logits.dtype, logits.stride())
    assert (g_entropy is None) == (entropy is None), "g_entropy and entropy come together"
    c, v = logits.shape
    target = target.to(torch.int64).contiguous()
    lse, g = lse.float().contiguous(), g.float().contiguous()
    pointers = (0, 0)
    if g_entropy is not None:
        g_entropy, entropy = g_entropy.float().contiguous(), entropy.float().contiguous()
        pointers = (g_entropy.data_ptr(), entropy.data_ptr())
    _native().row_grad_(logits.data_ptr(), _DTYPE_BITS[logits.dtype], target.data_ptr(), c, v, *_map(logit_map),
                        lse.data_ptr(), g.data_ptr(), *pointers)
    return logits


ROW_OPS = RowOps(stats=_stats, grad_=_grad_, slab_dtypes=tuple(_DTYPE_BITS))


def row_topk(logits, k: int, logit_map, target=None):
    """(values [C, k] f32, ids [C, k] int64, count_ge [C] int64, lse [C] f32, target_logit [C] f32 or None) of
    z = logit_map(logits [C, V]) (ops/topk.py), in one pass over the slab."""
    logits = _slab(logits)
    c, v = logits.shape
    values, ids = torch.empty(c, k, dtype=torch.float32), torch.empty(c, k, dtype=torch.int64)
    count_ge = torch.empty(c, dtype=torch.int64)
    lse = torch.empty(c, dtype=torch.float32)
    target_logit = None if target is None else torch.empty(c, dtype=torch.float32)
    target = None if target is None else target.to(torch.int64).contiguous()
    _native().row_topk(logits.data_ptr(), _DTYPE_BITS[logits.dtype], c, v, k, *_map(logit_map), values.data_ptr(),
                       ids.data_ptr(), count_ge.data_ptr(), lse.data_ptr(), 0 if target is None else target.data_ptr(),
                       0 if target_logit is None else target_logit.data_ptr())
    return values, ids, count_ge, lse, target_logit


# ----------------------------------------------------------------------------------------------
# The kept-set route (ops/kept.py): the chunk's logits and gradients walked by id in C++, the ragged
# rows through the same row passes as the full vocabulary's
# ----------------------------------------------------------------------------------------------


def _weight_args(weight, bias):
    assert weight.is_contiguous() and (bias is None or bias.dtype == weight.dtype)
    if weight.dtype not in _DTYPE_BITS:  # float16: the kernels read float32 or bfloat16 rows
        weight, bias = weight.float(), None if bias is None else bias.float()
    return weight, bias, _DTYPE_BITS[weight.dtype]


def _by_id(c: KeptChunk, vocab: int):
    """(order [Kc], starts [U + 1]): the chunk's entries sorted by id (stable) and where each distinct id's
    group starts (the C++ counting sort), computed once per chunk."""
    if c.by_id is None:
        k = c.ids.numel()
        order, starts = torch.empty(k, dtype=torch.int64), torch.empty(min(k, vocab) + 1, dtype=torch.int64)
        groups = _native().kept_group(c.ids.data_ptr(), k, vocab, order.data_ptr(), starts.data_ptr())
        c.by_id = (order, starts[:groups + 1])
    return c.by_id


def _kept_logits(hidden_c, weight, bias, c: KeptChunk):
    order, starts = _by_id(c, weight.shape[0])
    weight, bias, bits = _weight_args(weight, bias)
    hidden_c = hidden_c.float().contiguous()
    r = torch.empty(c.ids.numel(), dtype=torch.float32)
    bias_p = 0 if bias is None else bias.contiguous().data_ptr()
    _native().kept_logits(hidden_c.data_ptr(), weight.data_ptr(), bias_p, bits, hidden_c.shape[1], c.ids.data_ptr(),
                          c.rows.data_ptr(), order.data_ptr(), starts.data_ptr(), starts.numel() - 1, r.data_ptr())
    return r


def _kept_stats(r, c: KeptChunk, logit_map):
    rows = c.end - c.start
    logp, entropy, lse = (torch.empty(rows, dtype=torch.float32) for _ in range(3))
    target = c.target_local.contiguous()
    _native().csr_row_stats(r.data_ptr(), c.offsets.data_ptr(), target.data_ptr(), rows, *_map(logit_map),
                            logp.data_ptr(), entropy.data_ptr(), lse.data_ptr())
    return logp, entropy, lse


def _kept_grad_(r, c: KeptChunk, lse, g, logit_map, g_entropy=None, entropy=None):
    target = c.target_local.contiguous()
    lse, g = lse.float().contiguous(), g.float().contiguous()
    pointers = (0, 0)
    if g_entropy is not None:
        g_entropy, entropy = g_entropy.float().contiguous(), entropy.float().contiguous()
        pointers = (g_entropy.data_ptr(), entropy.data_ptr())
    _native().csr_row_grad_(r.data_ptr(), c.offsets.data_ptr(), target.data_ptr(), c.end - c.start, *_map(logit_map),
                            lse.data_ptr(), g.data_ptr(), *pointers)
    return r


def _kept_scatter(dr, hidden_c, weight, c: KeptChunk, grads: KeptGrads):
    order, starts = _by_id(c, weight.shape[0])
    weight, _, bits = _weight_args(weight, None)
    hidden_c = hidden_c.float().contiguous()
    gh = None if grads.grad_hidden is None else grads.grad_hidden[c.start:c.end]
    pointer = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    _native().kept_scatter(hidden_c.data_ptr(), weight.data_ptr(), bits, hidden_c.shape[1], c.end - c.start,
                           c.ids.data_ptr(), c.rows.data_ptr(), order.data_ptr(), starts.data_ptr(), starts.numel() - 1,
                           dr.contiguous().data_ptr(), pointer(gh), pointer(grads.grad_weight), pointer(grads.grad_bias))


def _kept_limits(hdim: int, threads: int) -> tuple[int, int]:
    # no gathered rows: a chunk's entries cost 8 bytes of logits and of their id-sorted order; its rows a
    # [C, H] float32 grad_hidden buffer per thread. A chunk as large as that allows: each weight row is
    # read once per chunk.
    return max(1, kept.CHUNK_BYTES // 16), max(1, kept.CHUNK_BYTES // (4 * hdim * max(threads, 1)))


KEPT_OPS = KeptOps(logits=_kept_logits, stats=_kept_stats, grad_=_kept_grad_, scatter=_kept_scatter,
                   chunk_limits=_kept_limits)

"""The `cpu` backend: the row passes of the chunk loop in C++ (`grpo_fast._C`, see csrc/).

The C++ passes take float32 or bfloat16 logit slabs by pointer; this file only checks layouts,
allocates the per-row outputs and passes pointers.
"""

from __future__ import annotations

import functools

import torch

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

"""The `cpu` backend: the row passes of the chunk loop in C++ (`grpo_fast._C`, see csrc/)."""

from __future__ import annotations

import torch

from .chunked import RowOps


def _native():
    try:
        from grpo_fast import _C
    except ImportError as err:
        raise ImportError(
            "backend='cpu' needs the native extension grpo_fast._C, which was not built; reinstall "
            "with `pip install --no-build-isolation -e .` (or use backend='torch')"
        ) from err
    return _C


def _stats(logits, target, temperature):
    logits = logits.contiguous()
    c = logits.shape[0]
    logp, entropy, lse = (torch.empty(c, dtype=torch.float32) for _ in range(3))
    target = target.to(torch.int64).contiguous()
    _native().row_stats(logits.data_ptr(), target.data_ptr(), c, logits.shape[1], float(temperature),
                        logp.data_ptr(), entropy.data_ptr(), lse.data_ptr())
    return logp, entropy, lse


def _grad_(logits, target, lse, g, temperature):
    assert logits.is_contiguous() and logits.dtype == torch.float32
    target = target.to(torch.int64).contiguous()
    lse, g = lse.float().contiguous(), g.float().contiguous()
    _native().row_grad_(logits.data_ptr(), target.data_ptr(), logits.shape[0], logits.shape[1], float(temperature),
                        lse.data_ptr(), g.data_ptr())
    return logits


ROW_OPS = RowOps(stats=_stats, grad_=_grad_)

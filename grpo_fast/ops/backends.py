"""Backend dispatch: which implementation computes the fused linear -> log-prob math.

A backend is an object with three functions over flattened tensors (hidden [N, H], weight [V, H],
bias [V] or None, target [N] int64):

    forward(hidden, weight, bias, target, logit_map) -> (logp, entropy, lse)          each [N] f32
    backward(hidden, weight, bias, target, lse, grad_logp, logit_map, needs)
        -> (grad_hidden, grad_weight, grad_bias)       needs = which of the three are wanted
    fused(hidden, weight, bias, target, logit_map, dloss_dlogp, needs)
        -> (logp, entropy, grad_hidden, grad_weight, grad_bias)   gradients in the forward pass

and the same three over kept sets (truncated sampling, ops/kept.py), every row's set non-empty:

    kept_forward(hidden, weight, bias, target, kept, logit_map) -> (logp, entropy, lse)   over each set
    kept_backward(hidden, weight, bias, target, kept, lse, grad_logp, logit_map, needs) -> grads
    kept_fused(hidden, weight, bias, target, kept, logit_map, dloss_dlogp, needs) -> (logp, entropy, *grads)

`dloss_dlogp(start, end, logp_chunk) -> g_chunk` is built inside the registered ops from tensors and
the loss options (grpo_fast/ops/grpo_loss.py); the backends split the rows into chunks with the
shared chunk driver (chunk_driver.py). Heavy imports (the native extension, Triton) happen here, when a
backend is first asked for.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from ..objective import BACKENDS
from . import kept, row_ops


def resolve(backend: str, device: torch.device) -> str:
    """The concrete backend name for `backend` on `device`, or a ValueError saying why not."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; expected one of {list(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else ("cpu" if device.type == "cpu" else "torch")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got tensors on {device.type}; on the CPU use "
            "backend='cpu' or 'torch', or set TRITON_INTERPRET=1 before importing grpo_fast to run "
            "the Triton kernels through Triton's interpreter"
        )
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device.type}")
    return backend


def _from_row_ops(ops: row_ops.RowOps, kept_ops: kept.KeptOps) -> SimpleNamespace:
    return SimpleNamespace(
        forward=functools.partial(row_ops.forward, ops),
        backward=functools.partial(row_ops.backward, ops),
        fused=functools.partial(row_ops.fused, ops),
        kept_forward=functools.partial(kept.forward, kept_ops),
        kept_backward=functools.partial(kept.backward, kept_ops),
        kept_fused=functools.partial(kept.fused, kept_ops),
    )


@functools.lru_cache(maxsize=None)
def get(name: str) -> SimpleNamespace:
    if name == "torch":
        return _from_row_ops(row_ops.TORCH_ROW_OPS, kept.TORCH_KEPT_OPS)
    if name == "cpu":
        from . import cpu

        return _from_row_ops(cpu.ROW_OPS, cpu.KEPT_OPS)
    if name == "triton":
        try:
            from grpo_fast.kernels import kept_logprobs, linear_logprobs
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(f"backend='triton' needs the `triton` package: {err}") from err
        return SimpleNamespace(
            forward=linear_logprobs.forward, backward=linear_logprobs.backward, fused=linear_logprobs.fused,
            kept_forward=kept_logprobs.kept_forward, kept_backward=kept_logprobs.kept_backward,
            kept_fused=kept_logprobs.kept_fused,
        )
    raise ValueError(f"backend={name!r} is unknown; expected one of {list(BACKENDS)}")

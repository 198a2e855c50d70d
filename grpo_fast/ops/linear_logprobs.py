"""`fused_linear_logprobs`: per-token log-prob (and entropy) of target ids straight from hidden
states and the lm_head weight, never materialising the `[tokens x vocab]` logits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import backends


@dataclass(frozen=True)
class LinearOptions:
    backend: str  # resolved: "triton" | "cpu" | "torch"
    temperature: float


def validate_linear(hidden, weight, target_ids, bias, temperature, backend) -> LinearOptions:
    """Check the inputs of the fused linear ops before any work; return the resolved options."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError(f"hidden must be a tensor [..., H], got {type(hidden).__name__} {getattr(hidden, 'shape', '')}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be the lm_head weight [V, H], got shape {list(getattr(weight, 'shape', []))}")
    vocab, h = weight.shape
    if hidden.shape[-1] != h:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree on H: hidden {list(hidden.shape)}, weight {list(weight.shape)}")
    if not isinstance(target_ids, torch.Tensor) or tuple(target_ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target_ids must have shape {list(hidden.shape[:-1])} (hidden without H), got {list(getattr(target_ids, 'shape', []))}")
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids must be an integer tensor, got dtype {target_ids.dtype}")
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share one floating dtype, got hidden {hidden.dtype}, weight {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (vocab,) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{vocab}] of dtype {weight.dtype}, got {list(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (hidden, weight, target_ids, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight, target_ids and bias must be on one device, got {sorted(map(str, devices))}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [V, H] (got strides {weight.stride()}); pass weight.contiguous()")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if target_ids.numel():
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target_ids must lie in [0, {vocab}) (the vocabulary of weight), found {bad}")
    return LinearOptions(backend=backends.resolve(backend, hidden.device), temperature=float(temperature))


class LinearLogprobsFunction(torch.autograd.Function):
    """logp, entropy = f(hidden [N, H], weight, bias); backward recomputes logit chunks/tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options: LinearOptions):
        impl = backends.get(options.backend)
        logp, entropy, lse = impl.forward(hidden, weight, bias, target, options.temperature)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.options = options
        ctx.mark_non_differentiable(entropy)  # a metric here; its gradient is not implemented
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        impl = backends.get(ctx.options.backend)
        needs = ctx.needs_input_grad[:3]
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float().contiguous()
        grads = impl.backward(hidden, weight, bias, target, lse, grad_logp, ctx.options.temperature, needs)
        return (*grads, None, None)


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
):
    """Log-probs of `target_ids` under `softmax((hidden @ weight.T + bias) / temperature)`.

    hidden `[..., H]` (float32/bfloat16/float16), weight `[V, H]` (same dtype, contiguous),
    target_ids `[...]` integer in `[0, V)`, bias `[V]` or None.
    Returns float32 log-probs `[...]`, differentiable w.r.t. hidden, weight and bias; with
    `return_entropy=True`, `(logp, entropy)` where entropy `[...]` is float32 and not differentiable.
    backend: "auto" (triton on CUDA, cpu on CPU), "triton", "cpu" or "torch".
    """
    options = validate_linear(hidden, weight, target_ids, bias, temperature, backend)
    lead = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    target = target_ids.reshape(-1).to(torch.int64).contiguous()
    logp, entropy = LinearLogprobsFunction.apply(hidden2d, weight, bias, target, options)
    logp, entropy = logp.view(lead), entropy.view(lead)
    return (logp, entropy) if return_entropy else logp

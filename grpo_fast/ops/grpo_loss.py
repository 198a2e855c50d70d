"""`fused_linear_grpo_loss`: the GRPO loss from hidden states and the lm_head weight.

The loss math is `grpo_fast.objective`'s, applied to per-token log-probs that the backends compute
without logits. Two routes, both exact:

- token-level ratio: the token loss depends only on the token's own log-prob and every aggregation
  is a fixed weight per token (`objective.loss_weights`), so the gradient of each logit chunk is
  known as soon as its log-probs are: one pass computes loss and gradients (3 matmuls, not 4).
- sequence-level ratio (GSPO): a token's gradient depends on its whole sequence, so log-probs come
  from `fused_linear_logprobs` and autograd recomputes logit chunks in the backward.

Tokens outside the mask are dropped before any matmul: padding costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import objective
from . import backends
from .linear_logprobs import LinearLogprobsFunction, LinearOptions, validate_linear


@dataclass(frozen=True)
class TokenLossPlan:
    """Everything the token loss needs besides the log-probs, for the active tokens only ([Na])."""

    advantages: torch.Tensor
    weights: torch.Tensor
    old_logp: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]
    is_weights: Optional[torch.Tensor]
    beta: float
    epsilon_low: float
    epsilon_high: Optional[float]
    delta: Optional[float]

    def dloss_dlogp(self, start: int, end: int, logp: torch.Tensor) -> torch.Tensor:
        """d(loss)/d(logp) for tokens [start, end): autograd through objective.per_token_loss."""
        part = lambda t: None if t is None else t[start:end]
        with torch.enable_grad():
            lp = logp.detach().requires_grad_(True)
            per_token, _, _ = objective.per_token_loss(
                lp, self.advantages[start:end], None,
                old_logp=part(self.old_logp), ref_logp=part(self.ref_logp), is_weights=part(self.is_weights),
                beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=self.delta,
            )
            (grad,) = torch.autograd.grad((per_token * self.weights[start:end]).sum(), lp)
        return grad


class FusedTokenGRPOLossFunction(torch.autograd.Function):
    """loss = finish(logp, entropy) with the gradients w.r.t. (hidden, weight, bias) computed in the
    forward pass (fused backends) and only scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options: LinearOptions, plan: TokenLossPlan, finish):
        impl = backends.get(options.backend)
        needs = ctx.needs_input_grad[:3]
        if any(needs):
            logp, entropy, *grads = impl.fused(hidden, weight, bias, target, options.temperature, plan.dloss_dlogp, needs)
        else:
            logp, entropy, _ = impl.forward(hidden, weight, bias, target, options.temperature)
            grads = [None, None, None]
        ctx.grads = grads
        return finish(logp, entropy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_grpo_loss: backward ran twice; its gradients were computed once, in forward")
        grads, ctx.grads = ctx.grads, None
        # scale in place: `g * grad_loss` would hold a second [V, H] weight gradient at the peak
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return (*grads, None, None, None, None)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    temperature: float = 1.0,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    backend: str = "auto",
):
    """GRPO loss `(loss, metrics)` with the semantics of `objective.grpo_loss_reference`.

    hidden `[B, T, H]`, weight `[V, H]`, target_ids `[B, T]`, advantages `[B]` or `[B, T]`,
    mask `[B, T]` (1 = completion token), old_logp / ref_logp / is_weights `[B, T]` or None,
    bias `[V]` or None. loss is a float32 scalar, differentiable w.r.t. hidden, weight and bias;
    metrics holds detached scalars: kl, entropy, clip_ratio/{low,high,region}_mean.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {list(hidden.shape)}")
    options = validate_linear(hidden, weight, target_ids, bias, temperature, backend)
    loss_options = dict(
        old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights, beta=beta, delta=delta,
        importance_sampling_level=importance_sampling_level,
    )
    agg = dict(loss_type=loss_type, max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch)
    objective.check_loss_inputs(hidden.shape[:2], target_ids=target_ids, advantages=advantages, mask=mask,
                                epsilon_low=epsilon_low, epsilon_high=epsilon_high, **loss_options, **agg)

    B, T, H = hidden.shape
    active = mask.reshape(-1) != 0
    idx = active.nonzero().squeeze(-1)
    everything = idx.numel() == B * T
    hidden_a = hidden.reshape(B * T, H)
    hidden_a = hidden_a.contiguous() if everything else hidden_a.index_select(0, idx)
    target_a = target_ids.reshape(-1).to(torch.int64)
    target_a = target_a.contiguous() if everything else target_a.index_select(0, idx)

    def active_part(t):
        if t is None:
            return None
        flat = t.unsqueeze(-1).expand(B, T) if t.dim() == 1 else t
        flat = flat.detach().reshape(-1).float()
        return flat if everything else flat.index_select(0, idx)

    def scatter(values_a, fill=None):
        """[Na] -> [B, T], masked places taken from `fill` (zeros when None)."""
        full = fill.detach().float().clone() if fill is not None else hidden.new_zeros(B, T, dtype=torch.float32)
        full.view(-1)[idx] = values_a
        return full

    if importance_sampling_level == "token":
        weights = objective.loss_weights(mask, **agg).to(hidden.device)
        plan = TokenLossPlan(
            advantages=active_part(advantages),
            weights=active_part(weights), old_logp=active_part(old_logp), ref_logp=active_part(ref_logp),
            is_weights=active_part(is_weights), beta=beta, epsilon_low=epsilon_low,
            epsilon_high=epsilon_high, delta=delta,
        )
        metrics = {}

        def finish(logp_a, entropy_a):  # loss value and metrics: the objective, on [B, T], no grad
            # masked places take the old log-prob: ratio 1, so they stay finite
            loss, metrics_ = objective.grpo_loss_from_logprobs(
                scatter(logp_a, old_logp), advantages, mask, entropy=scatter(entropy_a),
                epsilon_low=epsilon_low, epsilon_high=epsilon_high, **loss_options, **agg,
            )
            metrics.update(metrics_)
            return loss

        if not torch.is_grad_enabled():  # needs_input_grad ignores no_grad: detach so no gradient is computed
            hidden_a, weight, bias = (None if t is None else t.detach() for t in (hidden_a, weight, bias))
        loss = FusedTokenGRPOLossFunction.apply(hidden_a, weight, bias, target_a, options, plan, finish)
        return loss, metrics

    logp_a, entropy_a = LinearLogprobsFunction.apply(hidden_a, weight, bias, target_a, options)
    logp = scatter(logp_a, old_logp)  # masked places: ratio 1, so they stay finite
    return objective.grpo_loss_from_logprobs(
        logp, advantages, mask, entropy=scatter(entropy_a),
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, **loss_options, **agg,
    )

"""`fused_linear_grpo_loss`: the GRPO loss from hidden states and the lm_head weight.

The loss math is `grpo_fast.objective`'s, applied to per-token log-probs that the backends compute
without logits. Two routes, both exact:

- token-local losses (`LossOptions.token_local`: token-level ratios, every loss type but vespo):
  the token loss depends only on the token's own log-prob, every aggregation is a fixed weight per
  token (`objective.loss_weights`) and so is the entropy bonus's (`entropy_bonus_weights`), so the
  gradient of each logit chunk is known as soon as its log-probs are: one pass computes loss and
  gradients (3 matmuls, not 4). That pass is the custom op `grpo_fast::fused_linear_grpo_loss`.
- sequence-level ratios (GSPO, luspo) and vespo (whose weight needs the sequence's ratio product):
  a token's gradient depends on its whole sequence, so log-probs (and, for the entropy bonus, a
  differentiable entropy) come from `masked_linear_logprobs` and autograd recomputes logit chunks
  in the backward.

Tokens outside the mask are dropped before any matmul: padding costs nothing. With kept sets
(truncated sampling) both routes split the active tokens once more: those with a set take the kept-set
route (grpo_fast/ops/kept.py), the others the full vocabulary, in the same call.

The op takes tensors, which gradients to compute, and the loss options as scalars: one argument per
`LossOptions` field, its schema generated from the dataclass, so a new option needs no change here.
It returns the loss, the metrics as one tensor and the gradients it computed in its forward pass;
its registered backward only scales those by the incoming gradient.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Optional

import torch
from torch import Tensor

from .. import objective
from ..compat import autograd_inside_custom_op
from ..objective import DEFAULT_OPTIONS, KeptSets, LossOptions
from . import backends, kept, torch_library
from .linear_logprobs import (
    Rows,
    check_targets,
    fake_grads,
    kept_routes,
    masked_linear_logprobs,
    validate_kept,
    validate_linear,
)

OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions))
_SCHEMA_TYPES = {str: "str", float: "float", int: "int", bool: "bool", Optional[float]: "float?", Optional[int]: "int?"}
_HINTS = typing.get_type_hints(LossOptions)
_ARGS = ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor target_ids", "Tensor advantages", "Tensor mask",
         "Tensor? old_logp", "Tensor? ref_logp", "Tensor? is_weights", "Tensor? entropy_weights",
         "Tensor? num_items_in_batch", "Tensor? kept_ids", "Tensor? kept_offsets",
         "bool[] needs", "bool private_grads")
_ARGS += tuple(f"{_SCHEMA_TYPES[_HINTS[name]]} {name}" for name in OPTION_NAMES)
SCHEMA = f"({', '.join(_ARGS)}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
_ARG_NAMES = tuple(arg.split()[-1] for arg in _ARGS)


def _token_grad(options: LossOptions, tokens: dict, rows, logp: Tensor) -> Tensor:
    """d(loss)/d(logp) of the active tokens `rows` (a slice, or an index tensor where the kept sets split the
    tokens between two routes): autograd through the spec's per_token_loss."""
    part = {name: None if t is None else t[rows] for name, t in tokens.items()}
    with autograd_inside_custom_op():
        lp = logp.detach().requires_grad_(True)
        per_token, _, _ = objective.per_token_loss(lp, part["advantages"], None, options, old_logp=part["old_logp"],
                                                   ref_logp=part["ref_logp"], is_weights=part["is_weights"])
        (grad,) = torch.autograd.grad((per_token * part["weights"]).sum(), lp)
    return grad


def _loss_forward(hidden, weight, bias, target_ids, advantages, mask, old_logp, ref_logp, is_weights,
                  entropy_weights, num_items_in_batch, kept_ids, kept_offsets, needs, private_grads, *option_values):
    """(loss, metrics [len(all_metric_names())], grad_hidden, grad_weight, grad_bias); a gradient not in
    `needs` is empty, a metric the loss type does not report is 0.

    private_grads: the caller never reads the gradient outputs (`fused_linear_grpo_loss` drops them),
    so the backward may scale them in place (see `_loss_backward`)."""
    options = LossOptions(*option_values)
    rows = Rows(mask, mask.shape)
    hidden_a, target_a = rows.take(hidden), rows.take(target_ids).to(torch.int64)
    check_targets(target_a, weight.shape[0])
    routes = kept_routes(kept_ids, kept_offsets, rows, target_a, weight.shape[0])
    weights = objective.loss_weights(mask, options, num_items_in_batch).to(hidden.device)
    tokens = dict(advantages=rows.take_tokens(advantages), weights=rows.take_tokens(weights),
                  old_logp=rows.take_tokens(old_logp), ref_logp=rows.take_tokens(ref_logp),
                  is_weights=rows.take_tokens(is_weights))
    if options.entropy_coef != 0.0 and entropy_weights is None:
        entropy_weights = objective.entropy_bonus_weights(mask)
    impl = backends.get(options.backend)
    if any(needs):
        # the entropy bonus -coef * sum(H * weights): a constant gradient per token
        grad_entropy = None if options.entropy_coef == 0.0 else -options.entropy_coef * rows.take_tokens(entropy_weights)
        entropy_args = {} if grad_entropy is None else dict(grad_entropy=grad_entropy)
        if routes is None:
            dloss_dlogp = lambda s, e, lp: _token_grad(options, tokens, slice(s, e), lp)
            logp_a, entropy_a, *grads = impl.fused(hidden_a, weight, bias, target_a, options.logit_map, dloss_dlogp,
                                                   needs, **entropy_args)
        else:  # the kept sets' rows and the others, each route with its tokens' gradients
            dloss_at = lambda idx, lp: _token_grad(options, tokens, idx, lp)
            logp_a, entropy_a, *grads = kept.routed_fused(impl, hidden_a, weight, bias, target_a, routes,
                                                          options.logit_map, dloss_at, needs, **entropy_args)
    else:
        if routes is None:
            logp_a, entropy_a, _ = impl.forward(hidden_a, weight, bias, target_a, options.logit_map)
        else:
            logp_a, entropy_a, _ = kept.routed_forward(impl, hidden_a, weight, bias, target_a, routes, options.logit_map)
        grads = [None, None, None]
    # loss value and metrics: the spec on [B, T]; masked places take the old log-prob (ratio 1, finite)
    loss, metrics = objective.grpo_loss_from_logprobs(
        rows.put(logp_a, old_logp), advantages, mask, options, entropy=rows.put(entropy_a), old_logp=old_logp,
        ref_logp=ref_logp, is_weights=is_weights, entropy_weights=entropy_weights, num_items_in_batch=num_items_in_batch,
    )
    grads[0] = None if grads[0] is None else rows.put(grads[0])  # (B, T, H), 0 at inactive tokens
    grads = [hidden.new_empty(0) if g is None else g for g in grads]
    zero = loss.new_zeros(())
    return loss, torch.stack([metrics.get(name, zero) for name in objective.all_metric_names()]), *grads


def _loss_fake(hidden, weight, bias, target_ids, advantages, mask, old_logp, ref_logp, is_weights,
               entropy_weights, num_items_in_batch, kept_ids, kept_offsets, needs, private_grads, *option_values):
    f32 = dict(dtype=torch.float32, device=hidden.device)
    return torch.empty((), **f32), torch.empty(len(objective.all_metric_names()), **f32), *fake_grads(hidden, weight, bias, needs)


def _setup_context(ctx, inputs, output):
    args = dict(zip(_ARG_NAMES, inputs, strict=True))
    ctx.grads = [g if need else None for g, need in zip(output[2:], args["needs"], strict=True)]
    ctx.in_place = args["private_grads"]
    ctx.mark_non_differentiable(*output[1:])
    # Only the loss carries a gradient: without this, autograd would hand backward zeros shaped like
    # every other output, a [V, H] and an [N, H] it allocates and drops (+68 MB at the peak at
    # B4 T512 H512 V32k fp32, bench_loss.py's first size: 157 -> 121 MB).
    ctx.set_materialize_grads(False)


def _loss_backward(ctx, grad_loss, *_):
    grads, ctx.grads = ctx.grads, None  # dropped here, so autograd can take them as .grad without a copy
    if grads is None:
        raise RuntimeError("fused_linear_grpo_loss: backward ran twice; its gradients were computed once, in forward")
    if grad_loss is None:  # not materialised (see _setup_context); only the loss is differentiable
        return (None,) * len(_ARG_NAMES)
    # In place where nobody else reads them (private_grads) and in eager mode: `g * grad_loss` would
    # hold a second [V, H] weight gradient at the peak. Traced (torch.compile, opcheck: functional
    # tensor wrappers) a graph may not mutate a forward output in its backward, so it multiplies;
    # inductor then reuses the saved gradient's buffer for the product (a donated buffer).
    in_place = ctx.in_place and type(grad_loss) is torch.Tensor
    scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) if in_place else g * grad_loss.to(g.dtype)
              for g in grads]
    return (*scaled, *[None] * (len(_ARG_NAMES) - 3))


_loss_op = torch_library.define("fused_linear_grpo_loss", SCHEMA, _loss_forward, fake=_loss_fake, backward=_loss_backward,
                           setup_context=_setup_context)


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
    is_ratio: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    beta: float = LossOptions.beta,
    epsilon_low: float = LossOptions.epsilon_low,
    epsilon_high: Optional[float] = LossOptions.epsilon_high,
    delta: Optional[float] = LossOptions.delta,
    temperature: float = LossOptions.temperature,
    loss_type: str = LossOptions.loss_type,
    importance_sampling_level: str = LossOptions.importance_sampling_level,
    max_completion_length: Optional[int] = LossOptions.max_completion_length,
    num_items_in_batch=None,
    backend: str = LossOptions.backend,
    options: Optional[LossOptions] = None,
    kept: Optional[KeptSets] = None,
):
    """GRPO loss `(loss, metrics)` with the semantics of `objective.grpo_loss_reference`.

    hidden `[B, T, H]`, weight `[V, H]`, target_ids `[B, T]`, advantages `[B]` or `[B, T]`,
    mask `[B, T]` (1 = completion token), old_logp / ref_logp / is_weights / is_ratio (vespo) /
    entropy_weights `[B, T]` or None (see `objective.grpo_loss_from_logprobs`), bias `[V]` or None,
    num_items_in_batch: the normaliser of dapo, cispo and vespo (a number or a scalar tensor; None:
    the mask's sum). The loss options are the keywords from `beta` to `backend` (defaults:
    `objective.LossOptions`'s), or one `options=LossOptions(...)` (every option, the new loss types'
    and the entropy bonus's included) with those keywords left alone.
    loss is a float32 scalar, differentiable w.r.t. hidden, weight and bias (through the entropy
    too when options.entropy_coef != 0); metrics holds the detached scalars
    `objective.metric_names(options)` lists (kl, entropy, clip_ratio/*, policy_loss, ...).
    kept: truncated sampling's kept sets over the B T positions (`objective.KeptSets`; see
    `fused_linear_logprobs`): log-probs and entropies over each non-empty set, as `grpo_loss_reference(...,
    kept=kept)`; old_logp and ref_logp are expected over the same sets.
    """
    keywords = LossOptions(
        loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        temperature=temperature, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, backend=backend,
    )
    if options is None:
        options = keywords
    elif keywords != DEFAULT_OPTIONS:
        raise ValueError("pass the loss options either as options=LossOptions(...) or as keywords, not both")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {list(hidden.shape)}")
    resolved = validate_linear(hidden, weight, target_ids, bias, options.backend)
    validate_kept(kept, target_ids)
    objective.check_loss_inputs(hidden.shape[:2], options, target_ids=target_ids, advantages=advantages, mask=mask,
                                old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights, is_ratio=is_ratio,
                                entropy_weights=entropy_weights)
    num_items = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=torch.float32)
    names = objective.metric_names(options)

    if not options.token_local:
        # masked places take the old log-prob: ratio 1, so they stay finite
        logp, entropy = masked_linear_logprobs(hidden, weight, target_ids, mask, bias=bias,
                                               temperature=options.temperature, logit_scale=options.logit_scale,
                                               logit_softcap=options.logit_softcap, backend=resolved,
                                               return_entropy=True, fill=old_logp,
                                               differentiable_entropy=options.entropy_coef != 0.0, kept=kept)
        loss, metrics = objective.grpo_loss_from_logprobs(
            logp, advantages, mask, options, entropy=entropy, old_logp=old_logp, ref_logp=ref_logp,
            is_weights=is_weights, is_ratio=is_ratio, entropy_weights=entropy_weights, num_items_in_batch=num_items)
        return loss, {name: metrics[name] for name in names}

    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    concrete = dataclasses.replace(options, backend=resolved)
    kept_ids, kept_offsets = (None, None) if kept is None else (kept.ids, kept.offsets)
    loss, metrics, *_ = _loss_op(hidden, weight, bias, target_ids, advantages, mask, old_logp, ref_logp, is_weights,
                                 entropy_weights, num_items, kept_ids, kept_offsets, needs, True,
                                 *(getattr(concrete, name) for name in OPTION_NAMES))
    metrics = dict(zip(objective.all_metric_names(), metrics.unbind(), strict=True))
    return loss, {name: metrics[name] for name in names}

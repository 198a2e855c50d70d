"""`fused_linear_logprobs` and `masked_linear_logprobs`: per-token log-prob (and entropy) of target
ids straight from hidden states and the lm_head weight, never materialising the `[tokens x vocab]`
logits.

Both go through the custom op `grpo_fast::linear_logprobs` (its backward is the custom op
`grpo_fast::linear_logprobs_backward`): tensors and scalars in, tensors out, with fake (meta)
implementations, so `torch.compile(fullgraph=True)` keeps a function that calls them in one graph.
With a mask, the op selects the active tokens itself: padding costs no matmul, and no
data-dependent shape reaches a traced graph.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..objective import KeptSets, LogitMap
from . import backends, kept, torch_library


def validate_linear(hidden, weight, target_ids, bias, backend) -> str:
    """Check the inputs of the fused linear ops before any work; return the resolved backend name.

    Shapes, dtypes and devices only, so a traced function checks them too; the range of target_ids
    depends on their values and is checked inside the ops (`check_targets`)."""
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
    return backends.resolve(backend, hidden.device)


def validate_kept(kept, target_ids) -> None:
    """The kept sets' type, size and device against target_ids, before any work; their values (ids in the
    vocabulary, each target in its set) are checked inside the ops (`kept_routes`)."""
    if kept is None:
        return
    if not isinstance(kept, KeptSets):
        raise ValueError(f"kept must be an objective.KeptSets (CSR ids, offsets) or None, got {type(kept).__name__}")
    n = target_ids.numel()
    if kept.num_positions != n:
        raise ValueError(f"kept must hold one set per position of target_ids ({n}): offsets of {n + 1} entries, "
                         f"got {kept.offsets.numel()}")
    if kept.ids.device != target_ids.device:
        raise ValueError(f"kept must be on target_ids' device ({target_ids.device}), got {kept.ids.device}")


def kept_routes(kept_ids: Optional[Tensor], kept_offsets: Optional[Tensor], rows: "Rows", target: Tensor,
                vocab: int) -> Optional[kept.Routes]:
    """The active rows' routes (`kept.Routes`), or None where no active row has a non-empty set (the
    full-vocabulary path, bit for bit). Checks the sets' values: ids in the vocabulary, distinct, each
    active target in its set."""
    if kept_ids is None or kept_offsets is None:
        return None
    sets = KeptSets(kept_ids, kept_offsets)
    sets.check(rows.n, vocab, first_duplicate=_native_first_duplicate if kept_ids.device.type == "cpu" else None)
    if not rows.everything:
        sets = sets.select(rows.idx)
    sets.check_targets(target, positions=None if rows.everything else rows.idx)
    return kept.Routes.of(sets)


def _native_first_duplicate(sets: KeptSets, vocab: int) -> Optional[int]:
    """KeptSets.first_duplicate in one O(K + V) pass of the native extension (torch.sort of the entries took
    ~0.3 s at 512 positions x k = 512 on these CPUs); the sort where the extension is not built."""
    try:
        from grpo_fast import _C
    except ImportError:
        return sets.first_duplicate(vocab)
    ids, offsets = sets.ids.contiguous(), sets.offsets.contiguous()
    at = _C.kept_first_duplicate(ids.data_ptr(), offsets.data_ptr(), sets.num_positions, vocab)
    return None if at < 0 else at


def check_targets(target_ids: Tensor, vocab: int) -> None:
    """target_ids (the active ones) must index the vocabulary of weight."""
    if target_ids.numel():
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target_ids must lie in [0, {vocab}) (the vocabulary of weight), found {bad}")


class Rows:
    """The active tokens of a `[*lead]` mask (all of them without one): `take` selects them, in
    order, from `[*lead, ...]` tensors as `[Na, ...]`; `put` writes `[Na, ...]` results back."""

    def __init__(self, mask: Optional[Tensor], lead):
        self.lead = tuple(lead)
        self.n = math.prod(self.lead)
        self.idx = None if mask is None else (mask.reshape(-1) != 0).nonzero().squeeze(-1)
        self.everything = self.idx is None or self.idx.numel() == self.n

    def take(self, t: Tensor) -> Tensor:
        flat = t.reshape(self.n, *t.shape[len(self.lead):])
        return flat.contiguous() if self.everything else flat.index_select(0, self.idx)

    def take_tokens(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """A per-token input `[*lead]` (or `[B]`, broadcast over T) as float32 `[Na]`."""
        if t is None:
            return None
        t = t.unsqueeze(-1).expand(self.lead) if t.dim() < len(self.lead) else t
        return self.take(t.detach().float())

    def put(self, values: Tensor, fill: Optional[Tensor] = None) -> Tensor:
        """`[*lead, ...]`: `values` at the active tokens, `fill` (float32; zeros when None) elsewhere."""
        trailing = tuple(values.shape[1:])
        if self.everything and fill is None:
            return values.reshape(self.lead + trailing)
        full = fill.detach().float().clone() if fill is not None else values.new_zeros(self.lead + trailing)
        full.view(self.n, *trailing)[self.idx if self.idx is not None else slice(None)] = values
        return full


# ----------------------------------------------------------------------------------------------
# The registered ops
# ----------------------------------------------------------------------------------------------


def _linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target_ids: Tensor,
                     mask: Optional[Tensor], kept_ids: Optional[Tensor], kept_offsets: Optional[Tensor],
                     temperature: float, logit_scale: float, logit_softcap: Optional[float],
                     backend: str, entropy_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse), float32 shaped like target_ids, 0 where mask is 0. `backend` resolved;
    entropy_grad: whether the entropy is differentiable (else a metric, as lse is internal). kept_ids,
    kept_offsets: the kept sets (`objective.KeptSets`) over target_ids' positions, or None; lse is then
    each position's over its own set."""
    rows = Rows(mask, target_ids.shape)
    target = rows.take(target_ids).to(torch.int64)
    check_targets(target, weight.shape[0])
    routes = kept_routes(kept_ids, kept_offsets, rows, target, weight.shape[0])
    logit_map = LogitMap(temperature, logit_scale, logit_softcap)
    impl = backends.get(backend)
    if routes is None:
        logp, entropy, lse = impl.forward(rows.take(hidden), weight, bias, target, logit_map)
    else:
        logp, entropy, lse = kept.routed_forward(impl, rows.take(hidden), weight, bias, target, routes, logit_map)
    return rows.put(logp), rows.put(entropy), rows.put(lse)


def _linear_logprobs_fake(hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets, temperature, logit_scale,
                          logit_softcap, backend, entropy_grad):
    return tuple(hidden.new_empty(target_ids.shape, dtype=torch.float32) for _ in range(3))


def _linear_logprobs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target_ids: Tensor,
                              mask: Optional[Tensor], kept_ids: Optional[Tensor], kept_offsets: Optional[Tensor],
                              lse: Tensor, grad_logp: Tensor, temperature: float,
                              logit_scale: float, logit_softcap: Optional[float], backend: str,
                              needs: list[bool], entropy: Optional[Tensor],
                              grad_entropy: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum(grad_logp * logp [+ grad_entropy * entropy]) w.r.t. (hidden, weight, bias),
    recomputing logit chunks; an empty tensor where `needs` says not wanted (or there is no bias).
    entropy, grad_entropy: the forward's entropy and its incoming gradient, or both None."""
    rows = Rows(mask, target_ids.shape)
    g = rows.take(grad_logp).float().contiguous()
    entropy_args = {}
    if grad_entropy is not None:
        entropy_args = dict(grad_entropy=rows.take(grad_entropy).float().contiguous(),
                            entropy=rows.take(entropy).float().contiguous())
    target = rows.take(target_ids).to(torch.int64)
    routes = kept_routes(kept_ids, kept_offsets, rows, target, weight.shape[0])
    logit_map, impl = LogitMap(temperature, logit_scale, logit_softcap), backends.get(backend)
    if routes is None:
        grads = impl.backward(rows.take(hidden), weight, bias, target, rows.take(lse), g, logit_map, needs,
                              **entropy_args)
    else:
        grads = kept.routed_backward(impl, rows.take(hidden), weight, bias, target, routes, rows.take(lse), g,
                                     logit_map, needs, **entropy_args)
    grad_hidden = None if grads[0] is None else rows.put(grads[0])  # (*lead, H), 0 at inactive tokens
    return tuple(hidden.new_empty(0) if grad is None else grad for grad in (grad_hidden, *grads[1:]))


def fake_grads(hidden, weight, bias, needs) -> tuple[Tensor, Tensor, Tensor]:
    """What the ops return for (grad_hidden, grad_weight, grad_bias): contiguous, or empty where not wanted."""
    wanted = (needs[0], needs[1], needs[2] and bias is not None)
    return tuple(t.new_empty(t.shape) if want else hidden.new_empty(0)
                 for t, want in zip((hidden, weight, bias), wanted, strict=True))


def _linear_logprobs_backward_fake(hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets, lse, grad_logp,
                                   temperature, logit_scale, logit_softcap, backend, needs, entropy, grad_entropy):
    return fake_grads(hidden, weight, bias, needs)


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets, temperature, logit_scale, logit_softcap, backend,
     entropy_grad) = inputs
    ctx.save_for_backward(hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets, output[2],
                          output[1] if entropy_grad else None)
    ctx.logit_map, ctx.backend = (temperature, logit_scale, logit_softcap), backend
    # lse is internal; the entropy is a metric unless asked for (the entropy bonus)
    ctx.mark_non_differentiable(*((output[2],) if entropy_grad else (output[1], output[2])))


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets, lse, entropy = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    if entropy is None:
        grad_entropy = None
    if grad_logp is None:  # only the entropy reached the loss
        grad_logp = torch.zeros_like(lse)
    grads = torch.ops.grpo_fast.linear_logprobs_backward(hidden, weight, bias, target_ids, mask, kept_ids, kept_offsets,
                                                         lse, grad_logp, *ctx.logit_map, ctx.backend, needs,
                                                         entropy if grad_entropy is not None else None, grad_entropy)
    return (*(grad if need else None for grad, need in zip(grads, needs, strict=True)), *[None] * 9)


torch_library.define("linear_logprobs_backward",
                "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target_ids, Tensor? mask, Tensor? kept_ids, "
                "Tensor? kept_offsets, Tensor lse, "
                "Tensor grad_logp, float temperature, float logit_scale, float? logit_softcap, str backend, "
                "bool[] needs, Tensor? entropy, "
                "Tensor? grad_entropy) -> (Tensor, Tensor, Tensor)",
                _linear_logprobs_backward, fake=_linear_logprobs_backward_fake)
torch_library.define("linear_logprobs",
                "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target_ids, Tensor? mask, Tensor? kept_ids, "
                "Tensor? kept_offsets, float temperature, "
                "float logit_scale, float? logit_softcap, str backend, bool entropy_grad) -> (Tensor, Tensor, Tensor)",
                _linear_logprobs, fake=_linear_logprobs_fake, backward=_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def masked_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    backend: str = "auto",
    return_entropy: bool = False,
    fill: Optional[torch.Tensor] = None,
    differentiable_entropy: bool = False,
    kept: Optional[KeptSets] = None,
):
    """`fused_linear_logprobs` of the tokens where `mask` is set; the others cost nothing.

    hidden `[..., H]`, target_ids and mask `[...]` (mask None: every token). Returns float32 `[...]`
    log-probs, differentiable w.r.t. hidden, weight and bias, holding `fill` (detached; zeros when
    None) where the mask is 0; with `return_entropy=True`, `(logp, entropy)` where entropy is 0
    where the mask is 0, and differentiable only with `differentiable_entropy=True` (its gradient
    comes from the same backward pass as the log-probs': dH/dz = -p (log p + H) / T).
    logit_scale, logit_softcap: the model's own transform of its logits before the temperature
    (`objective.LogitMap`: Cohere's scale, Gemma 2's soft-cap), applied inside the op.
    kept: the sampler's kept sets (`objective.KeptSets` over target_ids' positions, row-major; see
    `fused_linear_logprobs`); a masked position's set is never read.
    """
    logit_map = LogitMap(float(temperature), float(logit_scale), None if logit_softcap is None else float(logit_softcap))
    backend = validate_linear(hidden, weight, target_ids, bias, backend)
    if mask is not None and tuple(mask.shape) != tuple(target_ids.shape):
        raise ValueError(f"mask must have shape {list(target_ids.shape)} (like target_ids), got {list(mask.shape)}")
    if fill is not None and (mask is None or tuple(fill.shape) != tuple(target_ids.shape)):
        raise ValueError(f"fill must come with a mask and have shape {list(target_ids.shape)}, got "
                         f"{list(fill.shape)} with mask {'None' if mask is None else list(mask.shape)}")
    validate_kept(kept, target_ids)
    # The op saves hidden for its backward: a view (the completion slice of a decoder's [B, L, H]
    # output) would keep its whole base alive until then, a contiguous copy only the [..., H] it reads.
    kept_ids, kept_offsets = (None, None) if kept is None else (kept.ids, kept.offsets)
    logp, entropy, _ = torch.ops.grpo_fast.linear_logprobs(hidden.contiguous(), weight, bias, target_ids, mask, kept_ids,
                                                           kept_offsets, *dataclasses.astuple(logit_map), backend,
                                                           bool(differentiable_entropy))
    if fill is not None:
        logp = torch.where(mask != 0, logp, fill.detach().float())
    return (logp, entropy) if return_entropy else logp


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_entropy: bool = False,
    backend: str = "auto",
    differentiable_entropy: bool = False,
    kept: Optional[KeptSets] = None,
):
    """Log-probs of `target_ids` under `softmax(LogitMap(temperature, logit_scale, logit_softcap)(hidden @ weight.T
    + bias))`: `(hidden @ weight.T + bias) / temperature` by default (`objective.LogitMap`).

    hidden `[..., H]` (float32/bfloat16/float16), weight `[V, H]` (same dtype, contiguous),
    target_ids `[...]` integer in `[0, V)`, bias `[V]` or None.
    Returns float32 log-probs `[...]`, differentiable w.r.t. hidden, weight and bias; with
    `return_entropy=True`, `(logp, entropy)` where entropy `[...]` is float32, differentiable only with
    `differentiable_entropy=True`.
    backend: "auto" (triton on CUDA, cpu on CPU), "triton", "cpu" or "torch".
    kept: truncated sampling's kept sets (`objective.KeptSets`, CSR over target_ids' positions, row-major):
    where a position's set is non-empty its log-prob and entropy are over that set (the renormalised
    distribution the sampler drew from; `objective.token_logprobs`), from the gathered lm_head rows of the
    set (O(k H) a position, gradients into those rows only); empty sets (and kept=None) take the full
    vocabulary, as without kept. A target outside its non-empty set is a ValueError.
    """
    return masked_linear_logprobs(hidden, weight, target_ids, None, bias=bias, temperature=temperature,
                                  logit_scale=logit_scale, logit_softcap=logit_softcap, backend=backend, return_entropy=return_entropy,
                                  differentiable_entropy=differentiable_entropy, kept=kept)

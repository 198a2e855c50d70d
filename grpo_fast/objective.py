"""The GRPO objective in plain PyTorch, from logits: **the specification**.

Every kernel and backend in grpo_fast is tested against this file, so it stays short and obviously
right. Semantics follow TRL's `GRPOTrainer` (see docs/design.md, "The objective"):

    lp      log-prob of the sampled token under logits / temperature
    ratio   w = exp(lp - old)                                   (token level)
            w = exp(sum_t M (lp - old) / sum_t M)               (sequence level, GSPO)
    loss    l = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)  (w first clamped to <= delta)
            l *= is_weight;  l += beta * (exp(ref - lp) - (ref - lp) - 1)
    reduce  grpo | bnpo | dr_grpo | dapo

The loss's static options are one frozen `LossOptions`, validated once when it is built; what
changes from call to call (tensors, the dapo normaliser `num_items_in_batch`) is a call argument.
The loss is split into `token_logprobs` (logits -> lp, entropy) and `grpo_loss_from_logprobs`
(lp -> loss, metrics): the fused ops compute the first part without ever holding logits and reuse
the second part unchanged, so the loss math exists exactly once.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
BACKENDS = ("auto", "triton", "cpu", "torch")
SCALE_REWARDS = ("group", "batch", "none")
STD_ESTIMATORS = ("population", "sample")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
METRIC_NAMES = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(allowed)}")


def _number(name: str, value, ok, allowed: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be {allowed}{' or None' if optional else ''}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossOptions:
    """The loss's static options, one object for the spec, the ops, the trainer and the TRL adapter.

    Adding a loss option is a field here (with its check in `__post_init__`) plus its math below;
    the fused ops carry every field to their kernels without naming it (grpo_fast/ops/grpo_loss.py).
    """

    loss_type: str = "dapo"
    """Aggregation: grpo | bnpo | dr_grpo | dapo (see `loss_weights`)."""
    beta: float = 0.0
    """KL coefficient against the reference policy (k3 estimator); > 0 needs ref_logp."""
    epsilon_low: float = 0.2
    """Lower PPO clip range: the ratio is clipped below at 1 - epsilon_low (TRL's `epsilon`)."""
    epsilon_high: Optional[float] = None
    """Upper clip range (DAPO clip-higher); None: epsilon_low."""
    delta: Optional[float] = None
    """Cap the ratio at delta (> 1) before the PPO clip (two-sided clipping, INTELLECT-2); None: off."""
    temperature: float = 1.0
    """Log-probs are taken under logits / temperature, as the sampler drew the tokens."""
    importance_sampling_level: str = "token"
    """Ratio per token (GRPO) or per sequence (GSPO)."""
    max_completion_length: Optional[int] = None
    """dr_grpo's constant divisor L; None: the batch's T."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss (the trainer's selection)."""
    backend: str = "auto"
    """Fused-op backend: auto (triton on CUDA, cpu on CPU), triton, cpu or torch."""

    def __post_init__(self):
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        _number("beta", self.beta, lambda v: 0 <= v < math.inf, "a finite number >= 0")
        _number("epsilon_low", self.epsilon_low, lambda v: 0 <= v < math.inf, "a finite number >= 0")
        _number("epsilon_high", self.epsilon_high, lambda v: 0 <= v < math.inf, "a finite number >= 0", optional=True)
        _number("delta", self.delta, lambda v: v > 1, "> 1 (it caps the ratio from above)", optional=True)
        _number("temperature", self.temperature, lambda v: 0 < v < math.inf, "a positive finite number")
        _choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        _number("max_completion_length", self.max_completion_length, lambda v: isinstance(v, int) and v >= 1,
                "an integer >= 1", optional=True)
        if not isinstance(self.mask_truncated_completions, bool):
            raise ValueError(f"mask_truncated_completions must be True or False, got {self.mask_truncated_completions!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; expected one of {list(BACKENDS)}")

    @property
    def clip_range(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high) with epsilon_high resolved."""
        return self.epsilon_low, self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_config(cls, config) -> "LossOptions":
        """From grpo_fast's `GRPOConfig` (its `epsilon` is epsilon_low, `loss_backend` the backend)."""
        c = config
        return cls(loss_type=c.loss_type, beta=c.beta, epsilon_low=c.epsilon, epsilon_high=c.epsilon_high,
                   delta=c.delta, temperature=c.temperature, importance_sampling_level=c.importance_sampling_level,
                   max_completion_length=c.max_completion_length,
                   mask_truncated_completions=c.mask_truncated_completions, backend=c.loss_backend)


DEFAULT_OPTIONS = LossOptions()


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    std: str = "population",
    eps: float = 1e-4,
    reward_weights: Optional[Sequence[float]] = None,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Group-relative advantages.

    rewards: `[n]` or `[n, k]` (k reward functions), consecutive blocks of `num_generations` rows
    form a group. NaN marks a missing reward (a reward function returned None): it is left out of
    the group statistics, and a sample with nothing known gets advantage 0.
    Returns float32 `[n]`: `(r - group_mean) / (std + eps)`, std per group ("group"), over the whole
    batch ("batch"), or no division ("none", Dr. GRPO). `std="sample"` uses the unbiased estimator
    (TRL); "population" the biased one. With k > 1, "sum_then_normalize" combines the weighted
    rewards first (TRL); "normalize_then_sum" normalises each function per group, then sums.
    """
    _choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _choice("std", std, STD_ESTIMATORS)
    _choice("aggregation", aggregation, REWARD_AGGREGATIONS)
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an integer >= 2 (a group needs a baseline), got {num_generations!r}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape [n] or [n, k], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64).reshape(rewards.shape[0], -1)  # (n, k)
    n, k = rewards.shape
    if n % num_generations != 0:
        raise ValueError(
            f"the number of rewards ({n}) must be a multiple of num_generations ({num_generations})"
        )
    weights = torch.ones(k, dtype=torch.float64) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float64)
    if weights.shape != (k,):
        raise ValueError(f"reward_weights must have one weight per reward function ({k}), got shape {tuple(weights.shape)}")
    if num_generations == 2:
        warnings.warn(
            "num_generations=2: every group of two becomes a full +-1 signal after normalisation, "
            "even when the rewards differ only by evaluator noise",
            stacklevel=2,
        )

    if aggregation == "sum_then_normalize":
        known = ~rewards.isnan().all(dim=1)
        total = torch.nansum(rewards * weights, dim=1)
        return _normalise(torch.where(known, total, torch.nan), num_generations, scale_rewards, std, eps)
    per_function = [_normalise(rewards[:, j], num_generations, scale_rewards, std, eps) for j in range(k)]
    return (torch.stack(per_function, dim=1).double() * weights).sum(dim=1).float()


def _normalise(r: torch.Tensor, num_generations: int, scale_rewards: str, std: str, eps: float) -> torch.Tensor:
    """(r - group mean) / (std + eps) over the known (non-NaN) entries of `r [n]`; 0 where r is NaN."""
    known = ~r.isnan()
    groups_r = r.view(-1, num_generations)  # (G, g)
    groups_known = known.view(-1, num_generations)
    count = groups_known.sum(dim=1, keepdim=True)
    mean = torch.nansum(groups_r, dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(groups_known, groups_r - mean, 0.0)
    correction = 1 if std == "sample" else 0
    if scale_rewards == "group":
        var = (centred**2).sum(dim=1, keepdim=True) / (count - correction).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    elif scale_rewards == "batch":
        r_known = r[known]
        denom = max(r_known.numel() - correction, 1)
        batch_std = ((r_known - r_known.mean()) ** 2).sum().div(denom).sqrt() if r_known.numel() else r.new_zeros(())
        centred = centred / (batch_std + eps)
    return centred.reshape(-1).float()


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0):
    """Log-prob of `target_ids` and entropy under `logits / temperature`, both float32 `[...]`."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def per_token_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
):
    """Token losses before aggregation: `(per_token, ratio, kl)`, all shaped like `logp`.

    At token level everything is elementwise, so any slice of tokens (`[N]` or `[B, T]`) works and
    `mask` is not read; the fused ops call this on chunks of tokens. Sequence level needs whole rows
    `[B, T]` and the mask. `advantages` is `[B]` (broadcast over T) or shaped like `logp`. `kl` is
    None without ref_logp.
    """
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={options.beta} needs ref_logp (the reference policy's log-probs), got None")
    epsilon_low, epsilon_high = options.clip_range
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() < logp.dim() else adv  # (B, 1) or like logp
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)

    log_ratio = logp - old
    if options.importance_sampling_level == "sequence":
        m = mask.to(logp.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if options.delta is not None:  # two-sided clipping (INTELLECT-2): cap the ratio before the PPO clip
        ratio = torch.clamp(ratio, max=options.delta)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:  # as TRL: the IS correction scales the policy-gradient term only
        per_token = per_token * is_weights.to(logp.dtype)
    kl = None
    if ref_logp is not None:
        d = ref_logp.to(logp.dtype) - logp
        kl = torch.exp(d) - d - 1  # k3 estimator
        if options.beta != 0.0:
            per_token = per_token + options.beta * kl
    return per_token, ratio.expand_as(logp), kl


def loss_weights(mask: torch.Tensor, options: LossOptions = DEFAULT_OPTIONS, num_items_in_batch=None) -> torch.Tensor:
    """Per-token weights `[B, T]` with `loss = sum(per_token * weights)` for every loss type.

    Every aggregation is linear in the token losses with weights known before the pass, which is
    what lets the fused kernels produce gradients in the same pass as the forward.
    num_items_in_batch: dapo's normaliser (a number or a scalar tensor); None: the mask's sum.
    """
    m = mask.to(torch.float32)
    B, T = m.shape
    if options.loss_type == "grpo":  # mean over sequences of the per-sequence token mean
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if options.loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if options.loss_type == "dr_grpo":
        length = T if options.max_completion_length is None else options.max_completion_length
        return m / (B * length)
    normaliser = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
    return m / normaliser.clamp(min=1.0)


def grpo_loss_from_logprobs(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    entropy: Optional[torch.Tensor] = None,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
):
    """The GRPO loss from per-token log-probs `logp [B, T]` (float32): `(loss, metrics)`.

    entropy, old_logp, ref_logp, is_weights: `[B, T]` or None; num_items_in_batch: see
    `loss_weights`. Metrics are detached scalars named as TRL logs them (METRIC_NAMES).
    """
    per_token, ratio, kl = per_token_loss(
        logp, advantages, mask, options, old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights
    )
    weights = loss_weights(mask, options, num_items_in_batch)
    loss = (per_token * weights).sum()
    return loss, clip_metrics(ratio, advantages, mask, options, kl, entropy)


def clip_metrics(ratio, advantages, mask, options: LossOptions = DEFAULT_OPTIONS, kl=None, entropy=None):
    """TRL's logged metrics: masked means of kl, entropy and the clipped fractions."""
    epsilon_low, epsilon_high = options.clip_range
    m = mask.to(torch.float32)
    adv = advantages.unsqueeze(-1) if advantages.dim() < ratio.dim() else advantages
    ratio = ratio.detach()

    def masked_mean(x):
        return ((x.detach().float() * m).sum() / m.sum().clamp(min=1.0))

    low = (ratio < 1 - epsilon_low) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    zero = torch.zeros((), device=ratio.device)
    return {
        "kl": masked_mean(kl) if kl is not None else zero,
        "entropy": masked_mean(entropy) if entropy is not None else zero,
        "clip_ratio/low_mean": masked_mean(low),
        "clip_ratio/high_mean": masked_mean(high),
        "clip_ratio/region_mean": masked_mean(low | high),
    }


def grpo_loss_reference(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
):
    """GRPO loss from materialised `logits [B, T, V]`: `(loss, metrics)`.

    target_ids `[B, T]` int; advantages `[B]` or `[B, T]`; mask `[B, T]` (1 = completion token);
    old_logp, ref_logp, is_weights `[B, T]` or None; num_items_in_batch: dapo's normaliser (see
    `loss_weights`). Metrics are detached scalars named as in TRL.
    """
    check_loss_inputs(logits.shape[:-1], options, target_ids=target_ids, advantages=advantages, mask=mask,
                      old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights)
    logp, entropy = token_logprobs(logits, target_ids, options.temperature)
    return grpo_loss_from_logprobs(logp, advantages, mask, options, entropy=entropy.detach(), old_logp=old_logp,
                                   ref_logp=ref_logp, is_weights=is_weights, num_items_in_batch=num_items_in_batch)


def check_loss_inputs(bt, options: LossOptions, *, target_ids, advantages, mask, old_logp=None, ref_logp=None,
                      is_weights=None) -> None:
    """Validate the loss's tensors against each other and the options (which checked themselves when
    built) before any work; errors name the argument and the shapes."""
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={options.beta} needs ref_logp (the reference policy's log-probs), got None")
    bt = tuple(bt)
    if len(bt) != 2:
        raise ValueError(f"expected [B, T, ...] inputs, got leading shape {bt}")
    given = {"target_ids": target_ids, "mask": mask, "old_logp": old_logp, "ref_logp": ref_logp, "is_weights": is_weights}
    for name, tensor in given.items():
        if tensor is not None and tuple(tensor.shape) != bt:
            raise ValueError(f"{name} must have shape {list(bt)} (B, T), got {list(tensor.shape)}")
    if tuple(advantages.shape) not in (bt[:1], bt):
        raise ValueError(f"advantages must have shape [{bt[0]}] or {list(bt)}, got {list(advantages.shape)}")

"""The GRPO objective in plain PyTorch, from logits: **the specification**.

Every kernel and backend in grpo_fast is tested against this file, so it stays short and obviously
right. Semantics follow TRL's `GRPOTrainer` (see docs/design.md, "The objective"):

    lp      log-prob of the sampled token under logits / temperature
    ratio   w = exp(lp - old)                                   (token level)
            w = exp(sum_t M (lp - old) / sum_t M)               (sequence level, GSPO)
    loss    l = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)  (w first clamped to <= delta)
            l *= is_weight;  l += beta * (exp(ref - lp) - (ref - lp) - 1)
    reduce  grpo | bnpo | dr_grpo | dapo

The loss is split into `token_logprobs` (logits -> lp, entropy) and `grpo_loss_from_logprobs`
(lp -> loss, metrics): the fused ops compute the first part without ever holding logits and reuse
the second part unchanged, so the loss math exists exactly once.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_ESTIMATORS = ("population", "sample")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
METRIC_NAMES = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(allowed)}")


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
    mask: torch.Tensor,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
):
    """Token losses before aggregation: `(per_token, ratio, kl)`, all shaped like `logp`.

    At token level everything is elementwise, so any slice of tokens (`[N]` or `[B, T]`) works;
    the fused ops call this on chunks of tokens. Sequence level needs whole rows `[B, T]`.
    `advantages` is `[B]` (broadcast over T) or shaped like `logp`. `kl` is None without ref_logp.
    """
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (the reference policy's log-probs), got None")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() < logp.dim() else adv  # (B, 1) or like logp
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)

    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        m = mask.to(logp.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if delta is not None:  # two-sided clipping (INTELLECT-2): cap the ratio before the PPO clip
        ratio = torch.clamp(ratio, max=delta)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:  # as TRL: the IS correction scales the policy-gradient term only
        per_token = per_token * is_weights.to(logp.dtype)
    kl = None
    if ref_logp is not None:
        d = ref_logp.to(logp.dtype) - logp
        kl = torch.exp(d) - d - 1  # k3 estimator
        if beta != 0.0:
            per_token = per_token + beta * kl
    return per_token, ratio.expand_as(logp), kl


def loss_weights(
    mask: torch.Tensor,
    loss_type: str = "dapo",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
) -> torch.Tensor:
    """Per-token weights `[B, T]` with `loss = sum(per_token * weights)` for every loss type.

    Every aggregation is linear in the token losses with weights known before the pass, which is
    what lets the fused kernels produce gradients in the same pass as the forward.
    """
    _choice("loss_type", loss_type, LOSS_TYPES)
    m = mask.to(torch.float32)
    B, T = m.shape
    if loss_type == "grpo":  # mean over sequences of the per-sequence token mean
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = T if max_completion_length is None else max_completion_length
        return m / (B * length)
    normaliser = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
    return m / normaliser.clamp(min=1.0)


def grpo_loss_from_logprobs(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: Optional[torch.Tensor] = None,
    loss_type: str = "dapo",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    **options,
):
    """The GRPO loss from per-token log-probs `logp [B, T]` (float32): `(loss, metrics)`.

    options: old_logp, ref_logp, is_weights, beta, delta, importance_sampling_level (see
    `per_token_loss`). Metrics are detached scalars named as TRL logs them.
    """
    _choice("loss_type", loss_type, LOSS_TYPES)
    _choice("importance_sampling_level", options.get("importance_sampling_level", "token"), IMPORTANCE_SAMPLING_LEVELS)
    per_token, ratio, kl = per_token_loss(
        logp, advantages, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high, **options
    )
    weights = loss_weights(mask, loss_type, max_completion_length, num_items_in_batch)
    loss = (per_token * weights).sum()
    return loss, clip_metrics(ratio, advantages, mask, kl, entropy, epsilon_low, epsilon_high)


def clip_metrics(ratio, advantages, mask, kl=None, entropy=None, epsilon_low=0.2, epsilon_high=None):
    """TRL's logged metrics: masked means of kl, entropy and the clipped fractions."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
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
    *,
    temperature: float = 1.0,
    **options,
):
    """GRPO loss from materialised `logits [B, T, V]`: `(loss, metrics)`.

    target_ids `[B, T]` int; advantages `[B]` or `[B, T]`; mask `[B, T]` (1 = completion token);
    options are those of `grpo_loss_from_logprobs` (old_logp, ref_logp, is_weights `[B, T]`,
    beta, epsilon_low, epsilon_high, delta, loss_type, importance_sampling_level,
    max_completion_length, num_items_in_batch). Metrics are detached scalars named as in TRL.
    """
    check_loss_inputs(logits.shape[:-1], target_ids=target_ids, advantages=advantages, mask=mask, **options)
    if temperature <= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    logp, entropy = token_logprobs(logits, target_ids, temperature)
    return grpo_loss_from_logprobs(logp, advantages, mask, entropy=entropy.detach(), **options)


def check_loss_inputs(bt, *, target_ids, advantages, mask, **options) -> None:
    """Validate loss options and shapes before any work; errors name the argument and the shapes."""
    _choice("loss_type", options.get("loss_type", "dapo"), LOSS_TYPES)
    _choice("importance_sampling_level", options.get("importance_sampling_level", "token"), IMPORTANCE_SAMPLING_LEVELS)
    if options.get("beta", 0.0) != 0.0 and options.get("ref_logp") is None:
        raise ValueError(f"beta={options['beta']} needs ref_logp (the reference policy's log-probs), got None")
    for name in ("epsilon_low", "epsilon_high"):
        if options.get(name) is not None and not 0 <= options[name]:
            raise ValueError(f"{name} must be >= 0, got {options[name]}")
    if options.get("delta") is not None and not options["delta"] > 1:
        raise ValueError(f"delta must be > 1 (it caps the ratio from above), got {options['delta']}")
    bt = tuple(bt)
    if len(bt) != 2:
        raise ValueError(f"expected [B, T, ...] inputs, got leading shape {bt}")
    expected = {"target_ids": bt, "mask": bt}
    for name in ("old_logp", "ref_logp", "is_weights"):
        if options.get(name) is not None:
            expected[name] = bt
    values = {"target_ids": target_ids, "mask": mask, **options}
    for name, shape in expected.items():
        if tuple(values[name].shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (B, T), got {list(values[name].shape)}")
    if tuple(advantages.shape) not in (bt[:1], bt):
        raise ValueError(f"advantages must have shape [{bt[0]}] or {list(bt)}, got {list(advantages.shape)}")

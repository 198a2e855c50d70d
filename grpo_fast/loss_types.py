"""The table of loss types: one frozen row per `loss_type`, the only place a loss type is spelled.

A row says what the type's token loss is (its surrogate, from the importance ratio), how token losses
become the loss (its aggregation: the per-token weights, and how the micro-batches of one optimizer
step add up), which metrics it reports beside kl, entropy and policy_loss, and whether each token's
loss depends on its own log-prob only (token-local: the fused ops then compute its gradient in the
same pass as the forward). The spec (objective.py), the trainer's micro-batch accumulation
(train/step.py), the fused ops and the TRL adapter all read the row; an unknown name raises
naming the known ones. A new loss type is its surrogate function plus one `register(LossType(...))`
call (tests/test_loss_types.py defines one in the test file alone).

    surrogate(ratio, t) -> per-token loss            t: the `TokenTerms` of the call
    metrics(ratio, t, masked_mean) -> {name: value}  the type's own metrics (masked token means)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .registry import Registry

# vespo's gamma weight works on the log of the sequence's ratio product, clamped as TRL does
VESPO_LOG_W_MIN, VESPO_LOG_W_MAX, VESPO_LOG_RATIO_CLAMP = math.log(1e-8), 20.0, 20.0


@dataclass(frozen=True)
class TokenTerms:
    """What a surrogate may read besides the ratio: log-probs, old log-probs, advantages (broadcast to
    the log-probs' shape), the completion mask, vespo's vLLM ratio, and the loss options."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor  # (B, 1) or like logp
    mask: Optional[torch.Tensor]
    is_ratio: Optional[torch.Tensor]
    options: object  # objective.LossOptions


@dataclass(frozen=True)
class Aggregation:
    """How token losses become the loss, `sum(per_token * weights(mask, options, num_items))`, and how
    the micro-batches of one optimizer step add up: each micro-batch's loss is multiplied by
    `accumulation(rows, step_rows, num_micro_batches)` before its backward.

    global_normaliser: divides by `num_items_in_batch`, the step's active-token count over every
    micro-batch and rank (dapo's), which the trainer and the TRL adapter pass."""

    name: str
    weights: Callable
    accumulation: Callable[[int, int, int], float]
    global_normaliser: bool = False
    per_sequence: bool = False  # each sequence weighs alike, whatever its length


def _sequence_mean(m, options, num_items):  # mean over sequences of each sequence's token mean
    return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * m.shape[0])


def _micro_batch_token_mean(m, options, num_items):
    return m / m.sum().clamp(min=1.0)


def _constant_length(m, options, num_items):  # Dr. GRPO: a constant L, so no length bias
    length = m.shape[1] if options.max_completion_length is None else options.max_completion_length
    return m / (m.shape[0] * length)


def _sequence_sum(m, options, num_items):  # mean over sequences of each sequence's token sum
    return m / m.shape[0]


def _global_token_mean(m, options, num_items):
    normaliser = m.sum() if num_items is None else torch.as_tensor(num_items, dtype=m.dtype)
    return m / normaliser.clamp(min=1.0)


def _by_rows(rows: int, step_rows: int, num_micro_batches: int) -> float:
    return rows / step_rows  # per-sequence means: a micro-batch counts as its share of the step's sequences


SEQUENCE_MEAN = Aggregation("sequence mean", _sequence_mean, _by_rows, per_sequence=True)
MICRO_BATCH_TOKEN_MEAN = Aggregation("token mean per micro-batch", _micro_batch_token_mean,
                                     lambda rows, step_rows, n: 1.0 / n)
CONSTANT_LENGTH = Aggregation("sum over B x max_completion_length", _constant_length, _by_rows)
SEQUENCE_SUM = Aggregation("sequence sum", _sequence_sum, _by_rows, per_sequence=True)
GLOBAL_TOKEN_MEAN = Aggregation("global token mean", _global_token_mean, lambda rows, step_rows, n: 1.0,
                                global_normaliser=True)


@dataclass(frozen=True)
class LossType:
    """One loss type: see the module docstring. token_local=False: the surrogate needs whole
    sequences (`[B, T]` with the mask), so the fused ops compute log-probs first, then the loss."""

    name: str
    surrogate: Callable
    aggregation: Aggregation
    metrics: Optional[Callable] = None
    metric_names: tuple = ()
    token_local: bool = True
    takes_is_ratio: bool = False  # folds the vLLM importance ratio in itself (vespo) instead of is_weights
    caps_ratio_at_delta: bool = False  # `delta` (two-sided clipping) caps the ratio before the surrogate
    warning: Optional[Callable] = None  # options -> a warning (TRL's) for a combination not meant, or None
    summary: str = ""


LOSS_TYPES: Registry = Registry("loss_type")  # name -> row, in registration order
register, unregister = LOSS_TYPES.register, LOSS_TYPES.unregister
loss_type = LOSS_TYPES.lookup  # the row of a name; an unknown name raises naming the known ones


def all_metric_names() -> tuple[str, ...]:
    """Every metric a loss can report: kl, entropy, each registered type's own, policy_loss."""
    own = dict.fromkeys(n for row in LOSS_TYPES.values() for n in row.metric_names)
    return ("kl", "entropy", *own, "policy_loss")


# ---- the surrogates --------------------------------------------------------------------------


def clipped_surrogate(ratio, t: TokenTerms):
    """PPO's clipped surrogate `-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)` (w capped at delta first)."""
    epsilon_low, epsilon_high = t.options.clip_range
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * t.advantages, clipped * t.advantages)


def clip_metrics(ratio, t: TokenTerms, masked_mean):
    epsilon_low, epsilon_high = t.options.clip_range
    low = (ratio < 1 - epsilon_low) & (t.advantages < 0)
    high = (ratio > 1 + epsilon_high) & (t.advantages > 0)
    return {"clip_ratio/low_mean": masked_mean(low), "clip_ratio/high_mean": masked_mean(high),
            "clip_ratio/region_mean": masked_mean(low | high)}


def cispo_surrogate(ratio, t: TokenTerms):
    """REINFORCE with a capped, stop-gradient importance weight."""
    return -torch.clamp(ratio, max=t.options.clip_range[1]).detach() * t.advantages * t.logp


def cispo_metrics(ratio, t: TokenTerms, masked_mean):
    return {"cispo_clip_ratio": masked_mean((ratio > t.options.clip_range[1]) & (t.advantages > 0))}


def sapo_surrogate(ratio, t: TokenTerms):
    """A soft sigmoid gate instead of the hard clip, sharper where A <= 0."""
    o = t.options
    tau = torch.where(t.advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * t.advantages


def vespo_surrogate(ratio, t: TokenTerms):
    """`-sg(phi(W)) A lp`, phi the gamma weight of the sequence's ratio product W."""
    return -vespo_weights(t.logp, t.old_logp, t.advantages, t.mask, t.options, t.is_ratio) * t.advantages * t.logp


def vespo_metrics(ratio, t: TokenTerms, masked_mean):
    return {"vespo/phi_seq_mean": masked_mean(vespo_weights(t.logp, t.old_logp, t.advantages, t.mask, t.options,
                                                            t.is_ratio))}


@torch.no_grad()
def vespo_weights(logp, old_logp, advantages, mask, options, is_ratio=None) -> torch.Tensor:
    """vespo's gamma weight `phi(W) = exp(lambda + k log W - lambda W)` (phi(1) = 1), detached, `[B, 1]`
    (or like `advantages` when that is `[B, T]`): W is the product of the sequence's token ratios
    (times the vLLM importance ratios `is_ratio`, when given), in log space and clamped as TRL does;
    (k, lambda) by the sign of the advantage (>= 0: the `_pos` pair)."""
    m = mask.to(logp.dtype)
    log_w = (torch.clamp(logp - old_logp, -VESPO_LOG_RATIO_CLAMP, VESPO_LOG_RATIO_CLAMP) * m).sum(-1, keepdim=True)
    if is_ratio is not None:  # masked: a padded place carries no ratio
        log_is = torch.clamp(torch.log(is_ratio.to(logp.dtype)), VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        log_w = log_w + (log_is * m).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    adv = advantages.unsqueeze(-1) if advantages.dim() < logp.dim() else advantages
    nonneg = adv >= 0
    k = torch.where(nonneg, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(nonneg, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

def _luspo_warning(options) -> Optional[str]:
    if options.importance_sampling_level != "sequence":
        return "loss_type='luspo' is meant for importance_sampling_level='sequence' (the paper's setup)"
    return None


def _vespo_warning(options) -> Optional[str]:
    if options.importance_sampling_level != "token":
        return ("loss_type='vespo' computes its sequence-level weight itself; importance_sampling_level should be "
                "'token' (the default)")
    return None


CLIPPED = dict(metrics=clip_metrics, metric_names=CLIP_METRICS, caps_ratio_at_delta=True)

# TRL 1.16's eight, in TRL's order
register(LossType("grpo", clipped_surrogate, SEQUENCE_MEAN, **CLIPPED,
                  summary="the clipped surrogate, mean over sequences of each sequence's token mean"))
register(LossType("bnpo", clipped_surrogate, MICRO_BATCH_TOKEN_MEAN, **CLIPPED,
                  summary="the clipped surrogate, token mean per micro-batch"))
register(LossType("dr_grpo", clipped_surrogate, CONSTANT_LENGTH, **CLIPPED,
                  summary="the clipped surrogate over B x max_completion_length (Dr. GRPO)"))
register(LossType("dapo", clipped_surrogate, GLOBAL_TOKEN_MEAN, **CLIPPED,
                  summary="the clipped surrogate, token mean over the whole optimizer step"))
register(LossType("cispo", cispo_surrogate, GLOBAL_TOKEN_MEAN, cispo_metrics, ("cispo_clip_ratio",),
                  summary="REINFORCE with the ratio capped at epsilon_high and stopped, dapo's mean"))
register(LossType("sapo", sapo_surrogate, SEQUENCE_MEAN,
                  summary="a soft sigmoid gate instead of the clip, grpo's mean"))
register(LossType("vespo", vespo_surrogate, GLOBAL_TOKEN_MEAN, vespo_metrics, ("vespo/phi_seq_mean",),
                  token_local=False, takes_is_ratio=True, warning=_vespo_warning,
                  summary="a gamma weight of the sequence's ratio product, dapo's mean"))
register(LossType("luspo", clipped_surrogate, SEQUENCE_SUM, **CLIPPED, warning=_luspo_warning,
                  summary="the clipped surrogate summed over each sequence, mean over sequences"))

"""One optimizer step over a slice of the generation batch: packed micro-batches, fused loss, backward.

Gradient accumulation keeps every aggregation global over the step, whatever the token budget cuts:

    dapo      num_items_in_batch = completion tokens of the whole generation batch / steps_per_generation
              (TRL's normaliser: the token mean over the generation batch, one step's share of it;
              the trainer passes it, the default is the step's own token count)
    grpo      each micro-batch's mean over its b sequences is scaled by b / B_step
    dr_grpo   Σ ℓM / (b · L_max) scaled by b / B_step  ->  Σ ℓM / (B_step · L_max)
    bnpo      each micro-batch's token mean / number of micro-batches (TRL's accumulation)

A non-finite loss or gradient norm skips the step: gradients are dropped, the weights and the
optimizer state stay as they were, and `skipped` is reported.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..objective import LossOptions
from ..ops import fused_linear_grpo_loss
from .forward import Packer, completion_hidden, policy_parts
from .rollouts import Rollouts

__all__ = ["LossOptions", "train_step", "trainable_mask", "trainable_tokens"]  # LossOptions: the trainer's import


def trainable_mask(batch: Rollouts, options: LossOptions) -> list[bool]:
    """Which completions enter the loss: non-empty ones, minus truncated ones when masked (DAPO)."""
    return [bool(ids) and not (options.mask_truncated_completions and reason == "length")
            for ids, reason in zip(batch.completion_ids, batch.finish_reason, strict=True)]


def trainable_tokens(batch: Rollouts, options: LossOptions) -> int:
    """Completion tokens that enter the loss."""
    return sum(len(c) for c, keep in zip(batch.completion_ids, trainable_mask(batch, options), strict=True) if keep)


def train_step(model, optimizer, packer: Packer, batch: Rollouts, options: LossOptions, max_grad_norm: float,
               num_items_in_batch: Optional[float] = None) -> dict:
    """Accumulate the loss of `batch` over packed micro-batches, clip, step. Returns metrics
    (loss, kl, entropy, clip_ratio/*, grad_norm, skipped, num_tokens). num_items_in_batch: the
    dapo normaliser (default: this step's trainable tokens)."""
    base, weight, bias = policy_parts(model)
    include = trainable_mask(batch, options)
    step_tokens = trainable_tokens(batch, options)
    num_items = step_tokens if num_items_in_batch is None else num_items_in_batch
    micro_batches = list(packer.micro_batches(batch.prompt_ids, batch.completion_ids, include))
    optimizer.zero_grad(set_to_none=True)
    totals, skipped, loss_sum = {}, False, 0.0
    for mb in micro_batches:
        loss, metrics = fused_linear_grpo_loss(
            completion_hidden(base, mb, packer.amp_dtype), weight, mb.target_ids,
            batch.advantages[mb.rows].to(weight.device), mb.completion_mask,
            old_logp=None if batch.old_logp is None else mb.pad(batch.old_logp),
            ref_logp=None if batch.ref_logp is None else mb.pad(batch.ref_logp),
            is_weights=None if batch.is_weights is None else mb.pad(batch.is_weights),
            bias=bias, num_items_in_batch=max(num_items, 1), options=options,
        )
        loss = loss * _accumulation_scale(options.loss_type, len(mb.rows), len(batch), len(micro_batches))
        if not torch.isfinite(loss):
            skipped = True
            break
        loss.backward()
        loss_sum += float(loss.detach())
        tokens = int(mb.completion_mask.sum())
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * tokens
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float("nan")
    if not skipped:
        clip = max_grad_norm if max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {name: total / max(step_tokens, 1) for name, total in totals.items()}
    out.update(loss=loss_sum if not skipped else float("nan"), grad_norm=grad_norm, skipped=float(skipped),
               num_tokens=float(sum(mb.num_tokens for mb in micro_batches)), num_micro_batches=float(len(micro_batches)))
    return out


def _accumulation_scale(loss_type: str, rows: int, step_rows: int, num_micro_batches: int) -> float:
    if loss_type in ("grpo", "dr_grpo"):
        return rows / step_rows
    if loss_type == "bnpo":
        return 1.0 / num_micro_batches
    return 1.0  # dapo: the global normaliser is num_items_in_batch

"""One optimizer step over a slice of the generation batch: packed micro-batches, fused loss, backward.

Gradient accumulation keeps every aggregation global over the step, whatever the token budget cuts:

    dapo      num_items_in_batch = completion tokens of the whole generation batch / steps_per_generation
              (TRL's normaliser: the token mean over the generation batch, one step's share of it;
              the trainer passes it, the default is the step's own token count)
    grpo      each micro-batch's mean over its b sequences is scaled by b / B_step
    dr_grpo   Σ ℓM / (b · L_max) scaled by b / B_step  ->  Σ ℓM / (B_step · L_max)
    bnpo      each micro-batch's token mean / number of micro-batches (TRL's accumulation)

The entropy bonus (TRL's): each micro-batch subtracts `entropy_coef x` its masked mean token entropy
divided by the number of micro-batches, whatever the loss type. cispo and vespo aggregate like
dapo, sapo like grpo, luspo like grpo's sequence mean of token sums.

The MoE router load-balancing loss (TRL's `aux_loss`; on by models/moe.py's rule): one Switch loss per
micro-batch over the tokens of its packed row (each sample's prompt + completion but the last token, a
target only, which never enters the decoder), times `router_aux_loss_coef` / the number of micro-batches.
TRL adds one per forward chunk (its `per_device_train_batch_size` padded sequences) times the coefficient /
the accumulation steps (whose forward routes each completion's last token too): the micro-batches here are
the token-budget groups above, and the step's router loss is their mean, as TRL's is its chunks' mean.

TRL's token masks: `top_entropy_quantile < 1` (train on a micro-batch's highest-entropy tokens) and
`off_policy_mask_threshold` (drop negative-advantage sequences far from the sampler) need the
current policy's log-probs and entropies before the loss: one extra no-grad lm_head pass per
micro-batch (`models.adapter.masked_logprobs`), then the masks multiply the policy-gradient term as TRL's do.

A non-finite loss or gradient norm skips the step: gradients are dropped, the weights and the
optimizer state stay as they were, and `skipped` is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import objective
from ..bounds import FINITE_AT_LEAST_0, FRACTION_OPEN_LOW, INTEGER_AT_LEAST_0, INTEGER_AT_LEAST_1, Bounds
from ..distributed import ONE_PROCESS, Parallel, any_rank, gather_rows, sum_over_ranks
from ..generation.batch import Rollouts
from ..loss_types import loss_type
from ..models import routing as routing_replay
from ..models.adapter import causal_lm_of, decoder_of, masked_logprobs
from ..models.moe import RouterStats, router_loss
from ..objective import LossOptions
from ..ops import fused_linear_grpo_loss, masked_linear_logprobs
from ..options import mirror, option, options_record
from . import kept_sets, sequence_parallel
from .forward import Packer, completion_hidden, policy_parts

__all__ = ["LossOptions", "optimizer_step", "step_metrics", "step_slices", "train_step", "trainable_mask",
           "trainable_tokens"]  # LossOptions: the trainer's import


def trainable_mask(batch: Rollouts, options: LossOptions) -> list[bool]:
    """Which completions enter the loss: those with a trained token, minus truncated ones when masked (DAPO)."""
    return [batch.trained_tokens(i) > 0 and not (options.mask_truncated_completions and reason == "length")
            for i, reason in enumerate(batch.finish_reason)]


def trainable_tokens(batch: Rollouts, options: LossOptions) -> int:
    """Completion tokens that enter the loss."""
    return sum(batch.trained_tokens(i) for i, keep in enumerate(trainable_mask(batch, options)) if keep)


def train_step(model, optimizer, packer: Packer, batch: Rollouts, options: LossOptions, max_grad_norm: float,
               num_items_in_batch: Optional[float] = None, *, top_entropy_quantile: float = 1.0,
               off_policy_mask_threshold: Optional[float] = None, parallel: Optional[Parallel] = None,
               importance_weights: Optional[Callable] = None, router_aux_loss_coef: Optional[float] = None,
               kept_source=None) -> dict:
    """Accumulate the loss of `batch` over packed micro-batches, clip, step. Returns metrics
    (loss, kl, entropy, the loss type's metrics, policy_loss, grad_norm, skipped, num_tokens) and
    `bonus_entropy`: the token mean of the entropy over the tokens the entropy bonus covers (what
    TRL's adaptive controller reads). num_items_in_batch: the normaliser of dapo, cispo and vespo
    (default: this step's trainable tokens). options.entropy_coef: the bonus applied in this step.
    parallel: many ranks (distributed.py): the decoder runs through the DDP module or the FSDP2
    root; DDP all-reduces the gradients at the last micro-batch only, FSDP2 reduce-scatters them at
    each (its forwards are collectives, so every rank runs as many micro-batches as the busiest one,
    the extra ones backing a zero); a non-finite loss on any rank skips the step on all of them.
    importance_weights: on-policy IS correction (one update per generation batch): `f(trainer_logp [C],
    sampling_logp [C]) -> IS weights [C]` of a completion, applied to the log-probs of this step's own
    forward (a no-grad lm_head pass per micro-batch), which are the old policy's here: no separate
    old-policy pass. Adds the `sampling/...` diagnostics of the engine-trainer gap to the metrics.
    router_aux_loss_coef: the MoE router loss's weight (TRL's; None: the model config's, models/moe.py);
    when on, adds `aux_loss` (the micro-batches' mean Switch loss, all ranks) and `moe/max_expert_load`.
    kept_source: truncated sampling (`kept_sets.KeptSource`): every log-softmax over the batch's kept sets
    (`Rollouts.kept`), which this step's own forward rebuilds where the batch has none yet (one update per batch)."""
    world = ONE_PROCESS if parallel is None else parallel.world
    wrapped = None if parallel is None else parallel.forward  # DDP module or FSDP2 root: its forward is the decoder's
    base = decoder_of(causal_lm_of(model))  # (the lm_head weight is read after each forward: FSDP2 unshards it there)
    router = router_loss(causal_lm_of(model), router_aux_loss_coef)  # None: a dense model, or the MoE's loss off
    sp = sequence_parallel.group_of(parallel)  # sequence parallelism: the group trains on its ranks' union, sharded
    batch = batch if sp is None else sp.union(batch)
    include = trainable_mask(batch, options)
    step_tokens = trainable_tokens(batch, options)
    num_items = step_tokens if num_items_in_batch is None else num_items_in_batch
    micro_batches = list(packer.micro_batches(batch.prompt_ids, batch.completion_ids, include, batch.routed_experts,
                                              kept=batch.kept, images=batch.image_inputs))
    micro_batches = sequence_parallel.shard_all(micro_batches, sp, base)
    rebuilds = kept_source is not None and kept_source.active and batch.kept is None  # (any batch without its sets)
    optimizer.zero_grad(set_to_none=True)
    totals, skipped, loss_sum = {}, False, 0.0
    policy_sum, bonus_entropy = 0.0, [0.0, 0.0]  # sum of H over the bonus's tokens, their count
    sampling_gap = _SamplingGap()  # with importance_weights: the engine-trainer log-prob gap and IS ratios
    truncation = kept_sets.TruncationStats(kept_source)  # ... its ratios, the mass the truncation cut
    truncation.rebuilt = rebuilds
    router_stats = RouterStats()  # with router: the micro-batches' Switch losses and the experts' loads
    for _ in range(parallel.rounds(len(micro_batches)) - len(micro_batches) if parallel is not None else 0):
        _zero_backward(model, wrapped, base, packer, sp)  # the collectives of the passes this rank lacks
    for k, mb in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        no_sync = parallel is not None and parallel.strategy == "ddp" and not last
        # one all-reduce a step; the engine's routing replayed (R3) through the backward too (checkpointing's recompute)
        with wrapped.no_sync() if no_sync else contextlib.nullcontext(), routing_replay.replaying(base, mb.routing), \
                sequence_parallel.attending(base, mb):
            if router is None:
                hidden = completion_hidden(base, mb, packer.amp_dtype, forward=wrapped)
            else:
                hidden, router_logits = completion_hidden(base, mb, packer.amp_dtype, forward=wrapped, router_logits=True)
            _, weight, bias = policy_parts(model)  # after the forward: FSDP2 has unsharded the root by now
            full = None  # truncated sampling: the full-vocab log-probs, where a rebuild computed them
            if rebuilds:  # the old policy's kept sets from this forward (no grad: its hidden states are the old policy's)
                mb.kept, _, missed, full = kept_sets.rebuild(
                    hidden, weight, bias, mb, kept_sets.sampled_positions(mb, batch.sampling_logp), kept_source.rule,
                    {"temperature": options.temperature, "logit_scale": options.logit_scale,
                     "logit_softcap": options.logit_softcap}, options.backend)
                truncation.missed(missed)
            mask = mb.completion_mask  # a rollout mode's masked tokens (injected text, a continued thought) leave it
            if batch.loss_mask is not None:
                mask = mask & (mb.pad(batch.loss_mask) > 0)
            advantages = batch.advantages[mb.rows].to(weight.device)
            old_logp = None if batch.old_logp is None else mb.pad(batch.old_logp)
            is_weights = None if batch.is_weights is None else mb.pad(batch.is_weights)
            if importance_weights is not None:
                is_weights = _in_step_is_weights(hidden, weight, bias, mb, batch, options, importance_weights,
                                                 sampling_gap, truncation, full)
            is_ratio = None
            if loss_type(options.loss_type).takes_is_ratio:  # vespo folds the IS ratio into its sequence weight
                is_ratio, is_weights = is_weights, None
            entropy = entropy_mask = None
            if top_entropy_quantile < 1.0 or off_policy_mask_threshold is not None:
                is_weights, entropy, entropy_mask = _trl_token_masks(hidden, weight, bias, mb, mask, batch, advantages,
                                                                     is_weights, options, top_entropy_quantile,
                                                                     off_policy_mask_threshold)
            scale = loss_type(options.loss_type).aggregation.accumulation(len(mb.rows), len(batch), len(micro_batches))
            entropy_weights = None
            if options.entropy_coef != 0.0:  # the micro-batch's mean / the micro-batches, after `scale` below
                covered = mask if entropy_mask is None else mask * entropy_mask
                entropy_weights = objective.entropy_bonus_weights(
                    mask, entropy_mask, normaliser=covered.sum().clamp(min=1.0) * len(micro_batches) * scale)
            loss, metrics = (fused_linear_grpo_loss if sp is None else sequence_parallel.loss_of(mb))(
                hidden, weight, mb.target_ids, advantages, mask, old_logp=old_logp,
                ref_logp=None if batch.ref_logp is None else mb.pad(batch.ref_logp),
                is_weights=is_weights, is_ratio=is_ratio, entropy_weights=entropy_weights,
                bias=bias, num_items_in_batch=max(num_items, 1), options=options,
                **({"kept": mb.kept} if mb.kept is not None else {}),
            )
            tokens = int(mask.sum())
            if entropy_mask is None:
                bonus_entropy[0] += float(metrics["entropy"]) * tokens
                bonus_entropy[1] += tokens
            else:
                bonus_entropy[0] += float((entropy * entropy_mask).sum())
                bonus_entropy[1] += float(entropy_mask.sum())
            loss = loss * scale
            if router is not None:  # TRL's: coef x the forward's router loss / the accumulation steps
                aux, assignments = objective.load_balancing_loss(router_logits, router.num_experts, router.top_k,
                                                                 return_assignments=True)
                loss = loss + router.coef * aux / len(micro_batches)
                router_stats.add(aux, assignments)
            if not torch.isfinite(loss):
                skipped = True
                if wrapped is None:
                    break  # (under DDP every rank runs its last backward: the gradients' all-reduce must meet)
            loss.backward()
            loss_sum += float(loss.detach())
            policy_sum += float(metrics.pop("policy_loss")) * scale  # summed like `loss`
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value) * tokens
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float("nan")
    skipped = any_rank(skipped, world)
    if not skipped:
        clip = max_grad_norm if max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2: a DTensor
        skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {name: total / max(step_tokens, 1) for name, total in totals.items()}
    bonus_entropy = sum_over_ranks(bonus_entropy, world)  # TRL's controller reads the all-rank token mean
    out["bonus_entropy"] = bonus_entropy[0] / max(bonus_entropy[1], 1.0)
    out["policy_loss"] = policy_sum if not skipped else float("nan")
    out.update(sampling_gap.metrics(world))
    if importance_weights is not None or rebuilds:  # (alike on every rank: the metrics gather over them)
        out.update(truncation.metrics(world))
    if batch.routed_experts is not None:  # the engine's routing against this step's forwards (all ranks record)
        out.update(routing_replay.metrics(sum_over_ranks(routing_replay.counts(mb.routing for mb in micro_batches), world)))
    if router is not None:
        out.update(router_stats.metrics(world))
    out.update(loss=loss_sum if not skipped else float("nan"), grad_norm=grad_norm, skipped=float(skipped),
               num_tokens=float(sum(mb.num_tokens for mb in micro_batches)),  # (sequence parallelism: this shard's)
               num_micro_batches=float(len(micro_batches)) / (1 if sp is None else sp.size))  # (... the group's share)
    return out


def _zero_backward(model, forward, base, packer: Packer, sp=None) -> None:
    """A forward of one token through the wrapped policy and the backward of zero times it: a rank
    with fewer micro-batches than another takes part in the gradient all-reduce (DDP) or in the
    layers' all-gathers and reduce-scatters (FSDP2) with zero gradients (sp: sharded, its all-to-alls too)."""
    (mb,) = sequence_parallel.shard_all(list(packer.micro_batches([[0]], [[0]])), sp, base)
    with sequence_parallel.attending(base, mb):
        hidden = completion_hidden(base, mb, packer.amp_dtype, forward=forward)
        _, weight, bias = policy_parts(model)  # an untied lm_head gets no gradient from the decoder
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0 + (0.0 if bias is None else bias.sum() * 0.0)
        zero.backward()


class _SamplingGap:
    """The engine-trainer diagnostics of an in-step IS correction, over all ranks: mean and max
    |trainer - sampler| log-prob gap per token, min / mean / max IS weight (as the trainer's
    separate old-policy pass reports them)."""

    def __init__(self):
        self.gaps, self.weights = [], []

    def add(self, gap: torch.Tensor, weights: torch.Tensor) -> None:
        self.gaps.append(gap)
        self.weights.append(weights)

    def metrics(self, world) -> dict:
        gaps, weights = (gather_rows(torch.cat(x) if x else torch.zeros(0), world) for x in (self.gaps, self.weights))
        if not gaps.numel():
            return {}
        return {"sampling/logp_diff_mean": gaps.mean().item(), "sampling/logp_diff_max": gaps.max().item(),
                "sampling/importance_sampling_ratio/min": weights.min().item(),
                "sampling/importance_sampling_ratio/mean": weights.mean().item(),
                "sampling/importance_sampling_ratio/max": weights.max().item()}


def _in_step_is_weights(hidden, weight, bias, mb, batch: Rollouts, options: LossOptions, importance_weights: Callable,
                        gap: _SamplingGap, truncation: "kept_sets.TruncationStats",
                        full: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The micro-batch's IS weights (b, Tc), each completion's from this forward's own log-probs (no grad), over
    its kept sets under truncated sampling (`full`: the full-vocab log-probs, where a rebuild computed them)."""
    with torch.no_grad():
        logp = _logprobs(hidden.detach(), weight, bias, mb, mb.completion_mask, options)[0].cpu()
        if mb.kept is not None and full is None:  # (the kept mass's other half: one more lm_head pass)
            full = masked_logprobs(hidden.detach(), weight, bias, mb.target_ids, mb.completion_mask, options=options)[0]
    whole = None if mb.kept is None else mb.unpad(full.cpu())
    out = torch.zeros_like(logp)
    for j, (i, trainer) in enumerate(zip(mb.rows, mb.unpad(logp), strict=True)):
        sampling = batch.sampling_logp[i]
        out[j, : len(trainer)] = weights = importance_weights(trainer, sampling)
        sampled = ~sampling.isnan()  # (NaN: a token the policy did not sample, a tool result: not a gap)
        gap.add((trainer - sampling).abs()[sampled], weights[sampled])
        truncation.add(trainer, sampling, None if whole is None else whole[j])
    return out.to(mb.target_ids.device)


def _logprobs(hidden, weight, bias, mb, mask, options: LossOptions):
    """(log-probs, entropies) (b, Tc) of the micro-batch's targets where `mask` is set, no grad: over its kept sets
    under truncated sampling (`mb.kept`), else `models.adapter.masked_logprobs` as it is."""
    if isinstance(mb, sequence_parallel.ShardedMicroBatch):  # the whole rows, summed over the group
        return sequence_parallel.logprobs(hidden, weight, bias, mb, mask, options)
    if mb.kept is None:
        return masked_logprobs(hidden, weight, bias, mb.target_ids, mask, options=options)
    return masked_linear_logprobs(hidden.to(weight.dtype), weight, mb.target_ids, mask, bias=bias, kept=mb.kept,
                                  temperature=options.temperature, logit_scale=options.logit_scale,
                                  logit_softcap=options.logit_softcap, backend=options.backend, return_entropy=True)


def _trl_token_masks(hidden, weight, bias, mb, mask, batch: Rollouts, advantages, is_weights, options: LossOptions,
                     top_entropy_quantile: float, off_policy_mask_threshold: Optional[float]):
    """TRL's off-policy sequence mask and high-entropy token mask of a micro-batch, from a no-grad
    pass of the current policy: (is_weights times the masks, entropy, the high-entropy mask or None)."""
    with torch.no_grad():
        logp, entropy = _logprobs(hidden.detach(), weight, bias, mb, mask, options)
    factors = [] if is_weights is None else [is_weights]
    if off_policy_mask_threshold is not None:
        sampling = mb.pad(batch.sampling_logp)
        factors.append(objective.off_policy_mask(advantages, logp, sampling, mask, off_policy_mask_threshold)
                       .expand_as(mask))
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = objective.high_entropy_mask(entropy, mask, 1.0 - top_entropy_quantile)
        factors.append(entropy_mask)
    return torch.stack(factors).prod(0), entropy, entropy_mask




# ---- the optimizer steps of a generation batch -----------------------------------------------


@options_record
@dataclass(frozen=True)
class StepOptions:
    """What the optimizer steps of a generation batch read: how the batch is cut into steps, the gradient clip,
    TRL's token masks, the adaptive entropy controller and when a run without signal stops
    (`StepOptions.from_config(config, group_size=config.group_size)`)."""

    group_size: int  # trained sequences per prompt (GRPOConfig.group_size, the rollout mode's): the caller's
    steps_per_generation: int = mirror(1)
    num_iterations: int = option(1, "Updates per generation batch (μ). > 1 computes old log-probs once per generation batch.", bounds=INTEGER_AT_LEAST_1)
    max_steps: int = mirror(20)
    router_aux_loss_coef: Optional[float] = option(None, "MoE models: weight of the router load-balancing loss (Switch Transformer, TRL's aux_loss, logged with moe/max_expert_load) added to the loss. None: the model config's router_aux_loss_coef (0 where it declares none: off); 0: off. Refused for a model that is not mixture-of-experts. Costs the router's softmax over the experts per layer and token.", bounds=FINITE_AT_LEAST_0)
    max_grad_norm: float = option(1.0, "Clip the global gradient norm to this (0: no clipping, the norm is still logged).", bounds=Bounds(low=0))
    top_entropy_quantile: float = option(1.0, "Train only on the highest-entropy tokens of each micro-batch: this share of them (TRL; 1.0: all). Costs a no-grad log-prob pass of the lm_head per micro-batch.", bounds=FRACTION_OPEN_LOW)
    off_policy_mask_threshold: Optional[float] = option(None, "Off-policy sequence mask (DeepSeek-V3.2, TRL): drop a negative-advantage completion from the loss when its mean log-prob gap (sampler minus current policy) exceeds this. None: off. Costs a no-grad log-prob pass of the lm_head per micro-batch.", bounds=Bounds(low=0))
    entropy_coef: float = mirror(0.0)  # the starting coefficient (LossOptions declares it)
    use_adaptive_entropy: bool = option(False, "Adapt entropy_coef each optimizer step (TRL): +entropy_coef_delta when the step's token entropy was <= entropy_target, else -delta; the bonus is applied only while the previous step's entropy was <= entropy_target.")
    entropy_coef_min: float = option(0.0, "Adaptive entropy: smallest coefficient.", bounds=FINITE_AT_LEAST_0)
    entropy_coef_max: float = option(1.0, "Adaptive entropy: largest coefficient.", bounds=FINITE_AT_LEAST_0)
    entropy_coef_delta: float = option(0.005, "Adaptive entropy: change of the coefficient per optimizer step.", bounds=FINITE_AT_LEAST_0)
    entropy_target: float = option(0.2, "Adaptive entropy: the token entropy (nats) the controller aims at.", bounds=FINITE_AT_LEAST_0)
    max_signal_free_steps: int = option(10, "Stop with an error after this many steps in a row without a training signal: no finite reward in the whole step, or the step skipped for a non-finite loss (each such step warns). Groups whose rewards all agree are normal and do not count. 0: never stop.", bounds=INTEGER_AT_LEAST_0)


def step_slices(batch: Rollouts, options: StepOptions, step: int) -> list[Rollouts]:
    """The optimizer steps a generation batch feeds: μ passes over steps_per_generation slices
    of whole groups, cut short at max_steps (`step`: the optimizer steps done)."""
    G = options.group_size
    slices = split_groups(len(batch) // G, options.steps_per_generation)
    parts = [batch.select([g * G + j for g in groups for j in range(G)]) for groups in slices]
    return (parts * options.num_iterations)[: options.max_steps - step]


def split_groups(num_groups: int, parts: int) -> list[list[int]]:
    """Split group indices into `parts` contiguous, nearly equal, non-empty slices."""
    parts = max(1, min(parts, num_groups))
    bounds = [round(i * num_groups / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def items_per_step(batch: Rollouts, steps: StepOptions, options: LossOptions, world) -> float:
    """dapo's normaliser (TRL's): the generation batch's trainable tokens shared evenly by its step slices
    (all ranks' tokens / ranks: DDP averages the ranks' gradients, TRL's normaliser under accelerate)."""
    tokens = sum_over_ranks([trainable_tokens(batch, options)], world)[0] / world.dp_size  # (a group trains its union)
    return tokens / min(steps.steps_per_generation, len(batch) // steps.group_size)


def optimizer_step(part: Rollouts, num_items: float, bar, policy, optimizer, scheduler, *, steps: StepOptions,
                   options: LossOptions, state, world, importance_weights: Optional[Callable] = None,
                   kept_source=None) -> dict:
    """One optimizer step of `policy` (`models.policy.Policy`) on `part` with the entropy bonus's coefficient now (TRL's adaptive controller
    moves it), then the schedule and the counters in `state` (steps, skipped steps, steps without signal)."""
    coef = steps.entropy_coef if state.entropy_coef is None else state.entropy_coef
    applied = objective.applied_entropy_coef(coef, state.last_entropy, adaptive=steps.use_adaptive_entropy,
                                             target=steps.entropy_target)
    metrics = train_step(policy.model, optimizer, policy.packer, part, dataclasses.replace(options, entropy_coef=applied),
                         steps.max_grad_norm, num_items_in_batch=max(num_items, 1.0),
                         top_entropy_quantile=steps.top_entropy_quantile, off_policy_mask_threshold=steps.off_policy_mask_threshold,
                         parallel=policy.parallel, importance_weights=importance_weights,
                         router_aux_loss_coef=steps.router_aux_loss_coef, kept_source=kept_source)
    bonus_entropy = metrics.pop("bonus_entropy")
    if steps.use_adaptive_entropy and not metrics["skipped"]:  # TRL's controller: the next step's coefficient and gate
        state.entropy_coef = objective.adaptive_entropy_coef(
            coef, bonus_entropy, target=steps.entropy_target, delta=steps.entropy_coef_delta, coef_min=steps.entropy_coef_min,
            coef_max=steps.entropy_coef_max)
        state.last_entropy = bonus_entropy
    if steps.entropy_coef != 0.0 or steps.use_adaptive_entropy:
        metrics["entropy_coef"] = coef if state.entropy_coef is None else state.entropy_coef
    else:
        metrics.pop("policy_loss")  # = loss without a bonus (TRL logs it only with one)
    with warnings.catch_warnings():  # a skipped step still advances the schedule
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    state.step += 1
    if metrics["skipped"]:
        state.skipped_steps += 1
        bar.print(f"step {state.step}: non-finite loss or gradient, step skipped (weights untouched)")
    count_signal(part, metrics["skipped"], state, world, bar)
    return metrics


def count_signal(part: Rollouts, skipped: bool, state, world, bar) -> None:
    """Count steps without a training signal: no finite reward at all, or a skipped update."""
    no_reward = not any_rank(not bool(part.rewards.isnan().all()), world)  # on no rank
    if not (no_reward or skipped):
        state.signal_free_steps = 0
        return
    state.signal_free_steps += 1
    why = ("every reward was None or non-finite: do the reward functions find the columns they read?"
           if no_reward else "the loss or gradient was non-finite and the update was skipped")
    bar.print(f"warning: step {state.step} had no training signal ({why}); "
              f"{state.signal_free_steps} such step(s) in a row")


def stop_without_signal(state, max_signal_free_steps: int, save: Optional[Callable[[], str]]) -> None:
    """Stop after max_signal_free_steps steps in a row without a training signal (`save`: keeps the progress)."""
    limit, count = max_signal_free_steps, state.signal_free_steps
    if limit and count >= limit:
        path = save() if save is not None else None
        raise RuntimeError(f"no training signal for {count} steps in a row (max_signal_free_steps={limit}): "
                           f"stopping{f'; progress saved to {path}' if path else ''}. Check the reward functions "
                           f"and the dataset's columns, or lower the learning rate if the loss is non-finite")


def step_metrics(part: Rollouts, batch: Rollouts, metrics: dict, stats: dict, times: dict, *, reward_funcs, options,
                 learning_rate: float, state) -> dict:
    """The logged line of one optimizer step: TRL's reward metrics of its slice `part`, the round's
    `stats`, the step's loss metrics (token means pooled over ranks by tokens), its time parts and throughput.
    options: the run's (`trainer.Options`: the loss's and the advantages')."""
    from ..reporting.metrics import Pooled
    from .score import COUNTER_PREFIXES, reward_metrics

    m = reward_metrics(part, reward_funcs, options.advantages)
    m.update(stats)
    m.update({k: v for k, v in metrics.items() if k != "skipped"})
    trained = trainable_tokens(part, options.loss)  # the loss's token means pool over ranks by tokens
    m.update({k: Pooled.weighted(m[k], trained) for k in objective.all_metric_names() if k != "policy_loss" and k in m})
    m.update(times)
    m["step_time"] = sum(v for k, v in m.items() if k.startswith("time/"))
    tokens = sum(len(p) + len(q) for p, q in zip(part.prompt_ids, part.completion_ids, strict=True))
    m["tokens_per_second"] = tokens / max(m["step_time"], 1e-9)
    m["learning_rate"] = learning_rate
    m["skipped_steps"] = state.skipped_steps
    m["rewards/non_finite"] = batch.stats.get("rewards_non_finite", 0)
    m.update({k: v for k, v in batch.stats.items()  # (where they apply)
              if k.endswith("/timeouts") or k.startswith(COUNTER_PREFIXES)})
    return m

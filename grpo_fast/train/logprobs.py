"""The log-probs stage: [no grad] old-policy and reference log-probs, and the importance-sampling (IS)
weights that correct for an engine whose log-probs are not the trainer's (TRL's
vllm_importance_sampling_* semantics).

Who computes the IS weights is decided once, at build (`ISPolicy.resolve`, from the run's `ISOptions`):

    HF engine              it samples with the policy itself: its log-probs are the trainer's, no IS
    one update per batch   (num_iterations = steps_per_generation = 1) the step's own forward gives
                           them (train/step.py's `importance_weights`); no old-policy pass runs
    otherwise              this stage: the old policy's log-probs, then the weights from them

The stage returns a `SideInputs` record; the loop puts its tensors into the batch the step reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..bounds import Bounds
from ..generation.batch import Rollouts
from ..models.precision import default_is_correction
from ..options import mirror, option, options_record
from ..reporting.metrics import Pooled
from . import sequence_parallel
from .forward import completion_logprobs
from .kept_sets import TruncationStats, policy_pass


@options_record
@dataclass(frozen=True)
class ISOptions:
    """What decides where the IS weights come from (`ISPolicy.resolve`): TRL's vllm_importance_sampling_* options,
    and what makes the batch stale or the update more than one per batch."""

    mode: str  # GRPOConfig.is_mode (vllm_importance_sampling_mode resolved for the loss type): the caller's
    vllm_importance_sampling_correction: Optional[bool] = option(None, "Correct the sampler/trainer mismatch with importance weights from the engine's sampling log-probs (TRL; costs one no-grad forward per generation batch, or only an lm_head pass per micro-batch when each batch trains once; never with the HF engine, which samples with the policy itself). None: on when the engine (vllm_dtype) or the trainer (its weights, or the decoder under mixed_precision) computes in bf16/fp16 — so on with the bf16 CPU defaults of an AMX or avx512_bf16 CPU — or with max_staleness >= 1 (stale tokens); off when both are float32, where vLLM and the trainer agree.")
    vllm_importance_sampling_cap: float = option(3.0, "Upper bound C of the IS ratio (TRL's vllm_importance_sampling_cap / _clip_max).", bounds=Bounds(low=0, low_open=True))
    vllm_importance_sampling_clip_min: Optional[float] = option(None, "Lower bound of the IS ratio (TRL). None: no lower bound.")
    max_staleness: int = mirror(0)
    num_iterations: int = mirror(1)
    steps_per_generation: int = mirror(1)

@dataclass(frozen=True)
class ISPolicy:
    """Where the IS weights come from in this run (module docstring)."""

    shares_weights: bool  # the engine samples with the policy itself (HF): nothing to correct, nothing to sync
    use_is: bool  # IS weights enter the loss
    in_step: bool  # ... computed by the step's own forward (one update per generation batch)
    needs_old_logp: bool  # the old policy's log-probs are a pass of their own (more than one update per batch)
    mode: str  # TRL's is_mode: token_/sequence_ x truncate/mask
    cap: float
    clip_min: Optional[float]

    @classmethod
    def resolve(cls, options: ISOptions, engine, model, trainer_dtype: torch.dtype) -> "ISPolicy":
        """From the options (`vllm_importance_sampling_correction`: None picks by the precisions and
        staleness), the engine and the trainer's precision; warns where an explicit True cannot apply."""
        shares = engine.shares_weights_with(model)
        use_is = options.vllm_importance_sampling_correction
        if use_is is None:
            use_is = default_is_correction(engine.dtype, trainer_dtype, options.max_staleness)
        if options.vllm_importance_sampling_correction and shares:
            warnings.warn("vllm_importance_sampling_correction=True has no effect with the HF engine: it samples with "
                          "the policy itself, so its log-probs are the trainer's (the correction stays off)",
                          stacklevel=3)
        on_policy = options.num_iterations == 1 and options.steps_per_generation == 1
        use_is = use_is and not shares
        return cls(shares_weights=shares, use_is=use_is, in_step=use_is and on_policy, needs_old_logp=not on_policy,
                   mode=options.mode, cap=options.vllm_importance_sampling_cap,
                   clip_min=options.vllm_importance_sampling_clip_min)

    def with_use_is(self, on: bool) -> "ISPolicy":
        return dataclasses.replace(self, use_is=on)

    def checks(self, step: int, every: int) -> bool:
        """Whether the stage measures the engine-vs-trainer gap at `step` (every `every` steps: sampling_check_steps;
        not where the step computes the IS weights: its own forward has the trainer's log-probs)."""
        return bool(every and step % every == 0 and not self.in_step)

    def weights(self, trainer_logp: torch.Tensor, sampling_logp: torch.Tensor) -> torch.Tensor:
        """The IS weights of one completion, from the trainer's and the sampler's log-probs."""
        return importance_weights(trainer_logp, sampling_logp, mode=self.mode, cap=self.cap, clip_min=self.clip_min)


@dataclass(frozen=True)
class SideInputs:
    """What the stage computed: each a list of `[C_i]` tensors, or None where the run does not need it."""

    old_logp: Optional[list]
    ref_logp: Optional[list]
    is_weights: Optional[list]
    metrics: dict  # sampling/*: the engine-vs-trainer log-prob gap, the IS ratios
    kept: Optional[list] = None  # truncated sampling: the kept sets the old policy's pass rebuilt (KeptTokens each)

    def into(self, batch: Rollouts) -> Rollouts:
        """The batch with these side inputs (a new Rollouts: the one given is not changed)."""
        rebuilt = {} if self.kept is None else {"kept": self.kept}
        return dataclasses.replace(batch, old_logp=self.old_logp, ref_logp=self.ref_logp, is_weights=self.is_weights,
                                   **rebuilt)


def side_inputs(batch: Rollouts, trained, policy: ISPolicy, *, temperature: float, backend: str, check: bool,
                kept_source=None) -> SideInputs:
    """Old-policy log-probs (where needed, or `check`: the sampling diagnostics' pass), IS weights
    (unless the step computes them), reference log-probs (beta > 0). No grad, no logits.
    trained: the policy (`models.policy.Policy`: model, packer, parallel, reference). The policy's pass replays the
    engine's routing where the batch carries it (routing replay); the reference routes by its own router.
    kept_source (`kept_sets.KeptSource`, truncated sampling): every pass over the batch's kept sets; the policy's
    pass rebuilds them first where the engine did not return them (it runs then for the reference too)."""
    truncated = kept_source is not None and kept_source.active
    kept = batch.kept
    sp = sequence_parallel.group_of(trained.parallel)  # sequence parallelism: sharded passes over the group's union
    logprobs_of = completion_logprobs if sp is None else functools.partial(sequence_parallel.completion_logprobs, group=sp)
    compute = lambda m, routed=None: logprobs_of(m, trained.packer, batch.prompt_ids,  # noqa: E731
                                                         batch.completion_ids, temperature=temperature,
                                                         backend=backend, routed_experts=routed, kept=kept,
                                                         images=batch.image_inputs)
    reference = trained.reference
    metrics = {}
    old_logp = is_weights = ref_logp = rebuilt = None
    if policy.needs_old_logp or check or (truncated and kept is None and reference is not None):
        stats = TruncationStats(kept_source)
        with trained.parallel.gathered():  # FSDP2: one all-gather for the pass; ranks run their own micro-batches
            if truncated:
                done = policy_pass(trained.model, trained.packer, batch, kept_source, temperature=temperature,
                                   backend=backend, routed_experts=batch.routed_experts)
                trainer_logp, rebuilt, kept = done.logp, done.kept, done.kept if done.kept is not None else kept
                stats.rebuilt = rebuilt is not None  # (every rank alike: its batch came without sets)
                stats.missed(done.misses)
            else:
                trainer_logp = compute(trained.model, batch.routed_experts)
        metrics.update(sampling_stats(trainer_logp, batch.sampling_logp))
        for i, (t, s) in enumerate(zip(trainer_logp, batch.sampling_logp, strict=True)):
            if t.numel() and s.numel() == t.numel():
                stats.add(t, s, done.full[i] if truncated else None)
        metrics.update(stats.metrics(trained.parallel.world))
        # on-policy, the loss takes old = lp.detach() itself: the diagnostic pass stays out of it
        old_logp = trainer_logp if policy.needs_old_logp else None
    if policy.use_is and not policy.in_step:
        is_weights = [policy.weights(o, s) for o, s in zip(old_logp, batch.sampling_logp, strict=True)]
        # (the sampled tokens' weights: a tool result or injected text has none, NaN sampling log-prob)
        flat = torch.cat([w[~s.isnan()] for w, s in zip(is_weights, batch.sampling_logp, strict=True)]) \
            if is_weights else torch.zeros(0)
        if flat.numel():
            metrics.update({"sampling/importance_sampling_ratio/min": flat.min().item(),
                            "sampling/importance_sampling_ratio/mean": Pooled.of(flat),
                            "sampling/importance_sampling_ratio/max": flat.max().item()})
    if reference is not None:
        with reference.parallel.gathered(), reference.scope():
            ref_logp = compute(reference.model)
    return SideInputs(old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights, metrics=metrics, kept=rebuilt)


def sampling_stats(old: list[torch.Tensor], sampling: list[torch.Tensor]) -> dict:
    """The engine's log-probs against the trainer's: mean and max |difference| over the batch's sampled tokens
    (a NaN sampling log-prob marks a token the policy did not sample: injected text, a tool result; left out)."""
    diffs = [(o - s).abs() for o, s in zip(old, sampling, strict=True) if o.numel() and s.numel() == o.numel()]
    flat = torch.cat(diffs) if diffs else torch.zeros(0)
    flat = flat[~flat.isnan()]
    if not flat.numel():
        return {}
    return {"sampling/logp_diff_mean": Pooled.of(flat), "sampling/logp_diff_max": flat.max().item()}




def importance_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, *, mode: str, cap: float,
                       clip_min: Optional[float]) -> torch.Tensor:
    """IS weights `[C]` of one completion: exp(trainer - sampler) per token (token_*) or per sequence
    (sequence_*, the summed difference, broadcast), truncated into [clip_min, cap] or zeroed outside.
    Tokens without a sampling log-prob (NaN: not trained) add nothing to a sequence's sum."""
    diff = torch.nan_to_num(old_logp.float() - sampling_logp.float(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum().expand_as(diff)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=cap)
    lo = -math.inf if clip_min is None else clip_min
    return ratio.masked_fill((ratio < lo) | (ratio > cap), 0.0)

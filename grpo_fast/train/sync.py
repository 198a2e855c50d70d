"""The sync stage: copy the new weights into the engine, then check that the engine samples from
the policy the trainer holds.

A failed or partial hot-swap (TRL hit one: sleep mode kept the old weights, trl#5312) would make
every later step train on samples of a stale policy, silently. After each sync the engine scores a
short probe (the last PROBE_TOKENS tokens of a sequence the policy just sampled: one prefill with
prompt log-probs, nothing decoded, since on a CPU every decode step reads all the weights; 0.3 s on
SmolLM2, against 0.7 s to decode 8 tokens), the trainer scores the
same tokens, and the mean |difference| of their log-probs is compared with a bound set by the
precision of the two sides (`tolerance`). Above it the trainer syncs once more and checks again;
still above it, the run stops with an error.
"""

from __future__ import annotations

import logging

import torch

from ..distributed import any_rank
from ..models.precision import trainer_dtype
from .forward import completion_logprobs

logger = logging.getLogger(__name__)

PROBE_TOKENS = 16

# Mean |engine - trainer| log-prob over the probe, by the lower precision of the two sides, from
# benchmarks/results/sync_check_cpu.md (SmolLM2, the ends of 8 sampled sequences): a float32 engine in
# sync differs by 6e-6..1e-5, one that missed a single step at lr 1e-5 by 0.007..0.027, so 1e-3
# catches one missed step with a margin of 7x below and 100x above. A bfloat16 engine in sync already
# differs by 0.031..0.074, as much as one missed step does: 0.15 (2x the largest in-sync gap) cannot
# see a few missed steps, only an engine about 10 steps stale (mean 0.147) or a swap that never lands,
# whose gap keeps growing with every step.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.15, torch.bfloat16: 0.15}


def tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype) -> float:
    """The bound for an engine computing in `engine_dtype` and a trainer in `trainer_dtype`
    (bf16 when its decoder runs under autocast)."""
    sides = [engine_dtype, trainer_dtype]
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in sides)


def probe_gap(engine, model, packer, token_ids: list[int], *, backend: str) -> float:
    """Mean |engine - trainer| log-prob of the last PROBE_TOKENS tokens of `token_ids`."""
    probe = list(token_ids[-PROBE_TOKENS:])
    if len(probe) < 2:
        return 0.0
    engine_logp = torch.tensor(engine.prompt_logprobs(probe), dtype=torch.float32)
    engine.reset_prefix_cache()  # the next round prefills as if no probe had run
    # the engine's prompt log-probs come from the raw logits: temperature 1 on the trainer's side
    trainer = completion_logprobs(model, packer, [probe[:1]], [probe[1:]], temperature=1.0, backend=backend)[0]
    return (trainer - engine_logp).abs().mean().item()


def sync_weights(engine, policy, *, shares_weights: bool, version: int = 0) -> None:
    """The policy's weights (`models.policy.Policy`) into the engine (none to copy where it samples with the policy itself).
    With a LoRA adapter only what it changes travels: the adapted layers merged from the untouched base
    (a partial update), or the adapter itself as `version` (vLLM's LoRA path)."""
    from ..models import lora

    if shares_weights:
        return
    if policy.lora_route == "merged":
        engine.update_weights(lora.engine_weights(policy.model, merged=True, only_adapted=True), partial=True)
    elif policy.lora_route == "adapter":
        engine.update_adapter(version, lora.adapter_tensors(policy.model))
    else:  # FSDP2: gathered layer by layer (every rank, in step); otherwise the live parameters
        engine.update_weights(policy.parallel.full_weights() if policy.parallel.sharded else policy.model)


def check_engine_sync(engine, policy, part, *, world, shares_weights: bool, backend: str,
                      step: int) -> dict:
    """The engine's log-probs of a short greedy probe against the trainer's (`models.policy.Policy`), after a sync;
    one re-sync when they differ beyond the tolerance of their precisions, then an error."""
    if shares_weights:
        return {}

    def gap_now() -> float:
        with policy.parallel.gathered():
            return probe_gap(engine, policy.model, policy.packer, probe, backend=backend)

    limit = tolerance(engine.dtype, trainer_dtype(policy.packer, policy.model))
    probe = part.prompt_ids[0] + part.completion_ids[0]  # text the policy itself wrote: its ending is the probe
    gap = gap_now()
    if any_rank(gap > limit, world):  # (every rank re-syncs: under FSDP2 a sync is collective)
        logger.warning("engine log-probs differ from the trainer's by %.3g (> %.3g) after a weight sync: syncing again",
                       gap, limit)
        sync_weights(engine, policy, shares_weights=shares_weights)
        gap = gap_now()
        if any_rank(gap > limit, world):
            raise RuntimeError(f"the rollout engine is out of sync with the policy after step {step}: its "
                               f"log-probs differ from the trainer's by {gap:.3g} on average (tolerance {limit:.3g} "
                               f"for these precisions) even after a second weight sync; training on its samples "
                               f"would train on a stale policy")
    return {"sampling/sync_check_diff": gap}

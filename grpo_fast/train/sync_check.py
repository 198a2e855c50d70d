"""After each weight sync: does the engine sample from the policy the trainer holds?

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

import torch

from .forward import completion_logprobs

PROBE_TOKENS = 16

# Mean |engine - trainer| log-prob over the probe, by the lower precision of the two sides, from
# benchmarks/results/sync_check_cpu.md (SmolLM2, 8 prompts): a float32 engine in sync differs by
# 2e-6..4e-6, one that missed a single step at lr 1e-5 by 0.011..0.053, so 1e-3 catches one missed
# step with 10x margin on either side. A bfloat16 engine in sync already differs by 0.017..0.032, as
# much as one missed step does (0.023..0.072): 0.08 (2.5x the largest in-sync gap) cannot see one
# missed step, but catches an engine 10 steps stale (0.11..0.85) and a swap that never lands.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 8e-2, torch.bfloat16: 8e-2}


def tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, amp: bool) -> float:
    """The bound for an engine computing in `engine_dtype` and a trainer in `trainer_dtype`
    (bf16 when its decoder runs under autocast)."""
    sides = [engine_dtype, torch.bfloat16 if amp else trainer_dtype]
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in sides)


def probe_gap(engine, model, packer, token_ids: list[int], *, backend: str) -> float:
    """Mean |engine - trainer| log-prob of the last PROBE_TOKENS tokens of `token_ids`."""
    probe = list(token_ids[-PROBE_TOKENS:])
    if len(probe) < 2:
        return 0.0
    engine_logp = torch.tensor(engine.prompt_logprobs(probe), dtype=torch.float32)
    if hasattr(engine, "reset_prefix_cache"):  # the next round prefills as if no probe had run
        engine.reset_prefix_cache()
    # the engine's prompt log-probs come from the raw logits: temperature 1 on the trainer's side
    trainer = completion_logprobs(model, packer, [probe[:1]], [probe[1:]], temperature=1.0, backend=backend)[0]
    return (trainer - engine_logp).abs().mean().item()

"""A checkpoint written by an older grpo_fast resumes with this one: tests/fixtures/partial_rollouts_0d71700 is
checkpoint-2 of a partial-rollout run (max_staleness 1, a 1-layer tiny Llama, groups in flight) written at commit
0d71700, with the step-3 metrics row that commit's own resume produced. This code's resume of it must carry the
same groups over and log the same row (within the last bits CPU kinds differ in)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from grpo_fast.generation.engines import vllm_available
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import rows, target_fraction

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "partial_rollouts_0d71700"
EXACT = ("reward", "completions/", "rollout/", "num_tokens", "rewards/", "step")  # from the sampled tokens


def test_a_0d71700_partial_rollout_checkpoint_resumes_with_its_groups_in_flight(tmp_path):
    from grpo_fast.run.resume import resumed_config
    from tests.tiny_model import load_tiny_model

    out = tmp_path / "run"
    shutil.copytree(FIXTURE / "checkpoint-2", out / "checkpoint-2")
    saved = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert saved["state"]["in_flight"], "the fixture must carry groups in flight"
    config = resumed_config({"output_dir": str(out), "resume_from_checkpoint": "latest", "max_steps": 3}, str(out),
                            "latest")  # every other option from the old checkpoint
    assert config.max_staleness == 1 and config.engine == "vllm"
    model, tokenizer = load_tiny_model(out / "checkpoint-2")  # (its generation config stops on 21 token ids)
    trainer = GRPOTrainer(config, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    want = json.loads((FIXTURE / "step3_at_0d71700.json").read_text())
    assert want["rollout/carried_over"] > 0
    bad = row_differences(got, want, "0d71700")
    assert not bad, "the resumed step 3 differs from 0d71700's own: " + "; ".join(bad)


def row_differences(got: dict, want: dict, commit: str) -> list[str]:
    """The keys of the metrics row `want` (an old commit's) that `got` (this code's row of the same step) does not
    match, each as 'key: got (commit: want)': exact where the sampled tokens decide, else within float32 rounding."""
    bad = []
    for key, expected in want.items():
        value = got.get(key)
        if key.startswith(EXACT):
            ok = value is not None and math.isclose(value, expected, rel_tol=1e-9)
        elif key == "loss":  # a near-zero sum of terms of the advantages' size: relative to those
            ok = abs(value - expected) <= 1e-4 * max(abs(expected), want["advantages/abs_mean"])
        elif key.startswith(("sampling/logp_diff", "sampling/sync_check_diff")) and expected < 1e-3:
            ok = value is not None and value < 1e-3  # rounding of the same numbers on two paths
        else:
            ok = value is not None and (value == expected or math.isclose(value, expected, rel_tol=1e-4))
        if not ok:
            bad.append(f"{key}: {value!r} ({commit}: {expected!r})")
    return bad

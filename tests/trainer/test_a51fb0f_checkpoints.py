"""Checkpoints written by commit a51fb0f resume with this code, as tests/trainer/test_old_checkpoint.py checks for
0d71700's: each fixture is checkpoint-2 of a 1-layer tiny Llama run with the step-3 metrics row a51fb0f's own resume
of it logged, and this code's resume must log the same row (within the last bits CPU kinds differ in).

- tests/fixtures/partial_rollouts_a51fb0f: partial rollouts (vLLM, max_staleness 1) with groups in flight;
- tests/fixtures/lora_a51fb0f: a LoRA adapter (r 4, vLLM, beta 0.04: the reference is the base, adapter disabled).
  Its base is not stored: base.json says how tests/tiny_model.py rebuilds it (seeded), and the weights' sha256.
  a51fb0f recorded the base by the path it had then (a temporary folder) and wrote no base_model.json (the sha256
  record this code checks on resume when there is one), so the resume names the rebuilt base with resume_override.

tests/fixtures/make_a51fb0f_fixtures.py wrote both (its docstring says how to regenerate them).
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo_fast.generation.engines import vllm_available
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import rows, target_fraction
from tests.trainer.test_old_checkpoint import row_differences

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROW = "step3_at_a51fb0f.json"


def _resume(fixture: Path, out: Path, given: dict, **trainer_args) -> dict:
    """This code's resume of a copy of the fixture's checkpoint-2 to step 3 (every option not given from the
    checkpoint): its step-3 metrics row."""
    from grpo_fast.run.resume import resumed_config

    config = resumed_config({"output_dir": str(out), "resume_from_checkpoint": "latest", "max_steps": 3, **given},
                            str(out), "latest")
    trainer = GRPOTrainer(config, [target_fraction], rows(), **trainer_args)
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]


def _check_row(got: dict, fixture: Path) -> dict:
    want = json.loads((fixture / ROW).read_text())
    assert got["step"] == want["step"] == 3
    bad = row_differences(got, want, "a51fb0f")
    assert not bad, "the resumed step 3 differs from a51fb0f's own: " + "; ".join(bad)
    return want


def _state(out: Path) -> dict:
    return torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)


def test_an_a51fb0f_partial_rollout_checkpoint_resumes_with_its_groups_in_flight(tmp_path):
    from tests.tiny_model import load_tiny_model

    fixture, out = FIXTURES / "partial_rollouts_a51fb0f", tmp_path / "run"
    shutil.copytree(fixture / "checkpoint-2", out / "checkpoint-2")
    saved = _state(out)
    assert saved["state"]["in_flight"], "the fixture must carry groups in flight"
    assert saved["config"]["max_staleness"] == 1 and saved["config"]["engine"] == "vllm"
    model, tokenizer = load_tiny_model(out / "checkpoint-2")  # the checkpoint's full model (its base is not here)
    got = _resume(fixture, out, {}, model=model, tokenizer=tokenizer)
    want = _check_row(got, fixture)
    assert want["rollout/carried_over"] > 0


def test_an_a51fb0f_lora_checkpoint_resumes_on_its_rebuilt_base(tmp_path):
    from transformers import GenerationConfig

    from tests.tiny_model import build_tiny_model

    fixture, out, base = FIXTURES / "lora_a51fb0f", tmp_path / "run", tmp_path / "base"
    record = json.loads((fixture / "base.json").read_text())
    build_tiny_model(base, **record["build_tiny_model"])
    generation = GenerationConfig.from_pretrained(base)
    generation.eos_token_id = record["generation_config.eos_token_id"]  # (the run's stop tokens, as vLLM reads them)
    generation.save_pretrained(base)
    digest = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    assert digest == record["model.safetensors sha256"], "tests/tiny_model.py no longer builds the fixture's base"
    shutil.copytree(fixture / "checkpoint-2", out / "checkpoint-2")
    saved = _state(out)
    assert saved["config"]["use_peft"] and saved["config"]["lora_r"] == 4 and saved["config"]["beta"] == 0.04
    assert saved["config"]["model"] == record["path at a51fb0f"]  # (an absolute path on the machine that wrote it)
    assert not (out / "checkpoint-2" / "base_model.json").exists(), "a51fb0f recorded no base weights' sha256"
    got = _resume(fixture, out, {"model": str(base), "resume_override": ["model"]})
    want = _check_row(got, fixture)
    assert want["kl"] > 0

"""The trainer on 2 gloo ranks (torchrun, DDP, one HF or in-process vLLM engine per rank; the spike of
docs/design.md) against one process with the same global batch: the ranks sample what the one
process samples (per-prompt seeds from the position in the global batch) and make the same updates,
up to float reduction order; rank 0 alone writes metrics, checkpoints and the final model; closing
a rank's vLLM engine leaves the trainer's process group alive."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "train_ranks.py")


def _run(cmd, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{"))), steps, load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_two_ranks_train_like_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    one, two = tmp_path / "one", tmp_path / "two"
    seen1, steps1, weights1 = _run([sys.executable, SCRIPT, tiny_model_dir, str(one), "16", engine], one)
    seen2, steps2, weights2 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    "2", SCRIPT, tiny_model_dir, str(two), "8", engine], two)
    assert seen1 == {"world": 1, "step": 2}
    assert seen2 == {"world": 2, "step": 2} | ({"all_reduce_after_close": 2.0} if engine == "vllm" else {})
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    _assert_trained_alike(steps1, weights1, steps2, weights2, initial)
    assert sorted(p.name for p in two.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-2"]
    assert (two / "final").is_dir()
    if engine == "hf":  # one checkpoint format for any number of ranks: 2 -> 1 with the same global batch
        resumed = tmp_path / "resumed"
        _, steps3, weights3 = _run([sys.executable, SCRIPT, tiny_model_dir, str(resumed), "16", engine,
                                    f"resume_from_checkpoint={two / 'checkpoint-1'}"], resumed)
        assert [s["step"] for s in steps3 if "loss" in s] == [2]
        assert steps3[0]["reward"] == pytest.approx(steps1[-2]["reward"], rel=1e-6), "step 2 samples as before"
        for name, w in weights1.items():
            update = (w - initial[name]).abs().max()
            assert (weights3[name] - w).abs().max() <= 1e-2 * update, name
        other = subprocess.run([sys.executable, SCRIPT, tiny_model_dir, str(tmp_path / "other"), "8", engine,
                                f"resume_from_checkpoint={two / 'checkpoint-1'}"], env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                               capture_output=True, text=True, timeout=600)
        assert other.returncode != 0 and "with 16 completions per step over all ranks" in other.stderr
        assert "per_device_train_batch_size x ranks x gradient_accumulation_steps = 8 x 1 x 1 = 8" in other.stderr


def _assert_trained_alike(steps1, weights1, steps2, weights2, initial):
    assert [s["step"] for s in steps2] == [s["step"] for s in steps1], "one metrics line per step and eval, by rank 0"
    for a, b in zip(steps1, steps2, strict=True):  # the same samples: the same rewards and lengths
        for name in ("reward", "completions/mean_length", "eval/accuracy", "eval/completions/mean_length"):
            if name in a:
                assert b[name] == pytest.approx(a[name], rel=1e-6), (name, a["step"])
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    for name, w in weights1.items():  # the same updates, up to reduction order (Adam magnifies it where grads ~ 0)
        update = (w - initial[name]).abs().max()
        assert update > 0 and (weights2[name] - w).abs().max() <= 1e-2 * update, name


def test_batch_scaled_advantages_use_every_ranks_rewards(tmp_path, tiny_model_dir):
    """scale_rewards='batch' divides by the std of the whole generation batch: 2 ranks, each holding
    half of it, must gather the other's rewards to train like one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    _, steps1, weights1 = _run([sys.executable, SCRIPT, tiny_model_dir, str(one), "16", "hf", "scale_rewards=batch"], one)
    _, steps2, weights2 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                SCRIPT, tiny_model_dir, str(two), "8", "hf", "scale_rewards=batch"], two)
    _assert_trained_alike(steps1, weights1, steps2, weights2, load_file(Path(tiny_model_dir) / "model.safetensors"))


def test_cli_launches_torchrun_for_one_node(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_fast.cli", "train", "--nproc_per_node", "2", "--model", tiny_model_dir,
           "--engine", "hf", "--max_steps", "1", "--num_generations", "4", "--per_device_train_batch_size", "8",
           "--max_completion_length", "8", "--eval_max_samples", "4", "--task_train_size", "16", "--disable_tqdm",
           "--output_dir", str(out)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("held-out accuracy:") == 1, "rank 0 alone reports"
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 1], "eval, the step, eval: written once each"

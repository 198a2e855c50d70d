"""A run killed at any moment (kill -9 at seeded points, inside a checkpoint write, halfway through a
metrics line, while final/ is written) or stopped by SIGTERM, then resumed, ends exactly where the
uninterrupted run ends; a resume passes over a damaged newest checkpoint for the previous intact one."""

import json
import os
import signal
import time

import pytest
from safetensors.torch import load_file

from tests.faults.conftest import fault_args, run, run_here, start

pytestmark = pytest.mark.slow


def _steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k not in ("step_time", "tokens_per_second")}
            for r in records if "reward" in r]


def _assert_same_run(out, reference):
    a = load_file(os.path.join(out, "final", "model.safetensors"))
    b = load_file(os.path.join(reference, "final", "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), f"{name}: the resumed run's final weights differ from the uninterrupted run's"
    assert _steps(out) == _steps(reference), "the resumed run's metrics differ from the uninterrupted run's"
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")], "a temporary checkpoint folder was left behind"


def test_kill9_at_seeded_points_then_resume_equals_uninterrupted(tmp_path, tiny_path, prompts_file, reference):
    out = tmp_path / "run"
    args = lambda *extra: fault_args(tiny_path, prompts_file, out, *extra)  # noqa: E731
    # 1. killed right after the 2nd optimizer step, before its checkpoint: checkpoint-1 survives
    code, _, _ = run(args(), fault="after_step:2")
    assert code == -signal.SIGKILL
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    # 2. resumed, killed inside its 2nd checkpoint write (checkpoint-3): a temporary folder is left
    code, _, _ = run(args("--resume"), fault="in_save:2")
    assert code == -signal.SIGKILL
    assert [n for n in os.listdir(out) if n.startswith(".tmp-checkpoint-3")], "the kill did not hit the checkpoint write"
    # 3. resumed (the temporary folder is cleaned up), killed halfway through a metrics line
    code, _, _ = run(args("--resume"), fault="in_metrics:2")
    assert code == -signal.SIGKILL
    assert not (out / "metrics.jsonl").read_text().endswith("\n"), "the metrics file should end in a torn line"
    # 4. the newest checkpoint is damaged since (a truncated shard: a bad disk, a partial copy), then resumed to
    # the end: it falls back to the previous checkpoint with one warning, and the torn line is dropped with another
    *previous, newest = sorted((p for p in out.iterdir() if p.name.startswith("checkpoint-")), key=lambda p: int(p.name[11:]))
    shard = newest / "distributed" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    code, _, err = run_here(args("--resume"))
    assert code == 0, err
    assert "torn last line" in err
    fallback = [line for line in err.splitlines() if f"{newest.name} is damaged" in line]
    assert len(fallback) == 1 and "__0_0.distcp" in fallback[0] and f"resuming from {previous[-1]}" in fallback[0], err
    _assert_same_run(str(out), reference)


def test_sigterm_while_training_saves_a_checkpoint_and_resume_equals_uninterrupted(tmp_path, tiny_path, prompts_file,
                                                                                   reference):
    out, sig = tmp_path / "run", signal.SIGTERM
    # no periodic checkpoints at all; each optimizer step takes a second more, for the signal to land in
    proc = start(fault_args(tiny_path, prompts_file, out, "--save_steps", "0"), fault="sleep_in_step:1")
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    last = err.strip().splitlines()[-1]
    assert "checkpoint saved" in last and "--resume" in last, last
    code, _, err = run_here(fault_args(tiny_path, prompts_file, out, "--resume"))
    assert code == 0, err
    _assert_same_run(str(out), reference)


def test_sigint_inside_a_reward_function_abandons_the_round_and_resume_equals_uninterrupted(tmp_path, tiny_path):
    from grpo_fast.trainer import GRPOTrainer, TrainingInterrupted
    from tests.tiny_model import load_tiny_model
    from tests.trainer.common import config, rows, target_fraction

    calls = []

    def ctrl_c_in_round_3(prompts, completions, completion_ids, **columns):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this reward function runs
        return target_fraction(prompts, completions, completion_ids)

    ctrl_c_in_round_3.__name__ = "target_fraction"

    def train(out, reward, **overrides):
        model, tokenizer = load_tiny_model(tiny_path)
        c = config(tmp_path, output_dir=str(tmp_path / out), max_steps=4, save_final=False, eval_before_train=False,
                   **overrides)
        GRPOTrainer(c, [reward], rows(), model=model, tokenizer=tokenizer).train()
        return model

    whole = train("whole", target_fraction)
    with pytest.raises(TrainingInterrupted, match=r"SIGINT at step 2: checkpoint saved to .*checkpoint-2.*--resume"):
        train("split", ctrl_c_in_round_3)
    resumed = train("split", target_fraction, resume_from_checkpoint="latest")
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert p.equal(q), f"{name} differs between the uninterrupted and the interrupted-then-resumed run"
    assert _steps(tmp_path / "split") == _steps(tmp_path / "whole")


LORA = ("--use_peft", "--lora_r", "4", "--beta", "0.04", "--save_merged")


def test_a_lora_run_killed_and_stopped_then_resumed_equals_the_uninterrupted_one(tmp_path, tiny_path, prompts_file):
    """kill -9 after a step (before its checkpoint), then SIGTERM while training, then kill -9 while final/ is
    written (after the last checkpoint): the adapter, its AdamW state and the run state resume exactly (checkpoints
    hold the adapter, not the model), and the last resume writes the final/ and merged/ the run had left to write."""
    args = lambda out, *extra: fault_args(tiny_path, prompts_file, out, *LORA, *extra)  # noqa: E731
    reference = tmp_path / "reference"
    code, _, err = run_here(args(reference))
    assert code == 0, err
    out = tmp_path / "run"
    code, _, _ = run(args(out), fault="after_step:2")
    assert code == -signal.SIGKILL
    assert not list((out / "checkpoint-1").glob("model*.safetensors")) and (out / "checkpoint-1" / "adapter_config.json").exists()
    proc = start(args(out, "--resume"), fault="sleep_in_step:1")
    metrics, deadline = out / "metrics.jsonl", time.time() + 120
    while metrics.read_text().count('"loss"') < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # (step 2 is trained again after the kill: signal once step 3 has trained)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    code, _, _ = run(args(out, "--resume"), fault="in_final:1")
    assert code == -signal.SIGKILL
    assert (out / "checkpoint-4").is_dir() and not (out / "final").exists(), "the kill did not hit the final/ write"
    code, printed, err = run_here(args(out, "--resume"))  # it said "nothing to train" and never wrote final/
    assert code == 0, err
    assert "nothing to train" not in printed
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        written = load_file(out / "final" / name)
        for key, tensor in load_file(reference / "final" / name).items():
            assert tensor.equal(written[key]), (name, key)
    assert _steps(str(out)) == _steps(str(reference)), "the resumed run's metrics differ from the uninterrupted run's"

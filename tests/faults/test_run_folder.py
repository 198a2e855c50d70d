"""The output folder: a fresh run never destroys an earlier one, one run writes at a time, a full
disk is named and cleaned up, and the checks that come before any work."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_fast.run import checkpoint
from grpo_fast.run.folder import RunLock
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction


def _train(tmp_path, tiny, **overrides):
    model, tokenizer = tiny
    c = config(tmp_path, eval_before_train=False, save_final=True, **overrides)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    trainer.train()
    return trainer


def _metric_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if '"reward"' in line]


def test_fresh_run_refuses_an_earlier_runs_folder_before_loading_anything(tmp_path, tiny):
    _train(tmp_path, tiny, max_steps=2, save_steps=1, save_total_limit=None)
    out = tmp_path / "run"
    assert (out / "checkpoint-2").is_dir()
    with pytest.raises(ValueError, match=r"already holds files .*--resume.*--overwrite_output_dir"):
        # a model path that does not exist: the folder check must come first
        GRPOTrainer(config(tmp_path, model=str(tmp_path / "no-model")), [target_fraction], rows())
    assert (out / "checkpoint-2").is_dir() and _metric_steps(out) == [1, 2]


def test_overwrite_output_dir_replaces_the_earlier_run(tmp_path, tiny, tiny_path):
    from tests.tiny_model import load_tiny_model

    _train(tmp_path, tiny, max_steps=3, save_steps=1, save_total_limit=None)
    _train(tmp_path, load_tiny_model(tiny_path), max_steps=1, save_steps=1, save_total_limit=1, overwrite_output_dir=True)
    out = tmp_path / "run"
    # the old checkpoint-2/3 are gone (they would otherwise outrank the new run's and be resumed)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    assert _metric_steps(out) == [1]


def test_torchrun_restart_resumes_by_itself(tmp_path, tiny, tiny_path, monkeypatch):
    from tests.tiny_model import load_tiny_model

    _train(tmp_path, tiny, max_steps=1, save_steps=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = _train(tmp_path, load_tiny_model(tiny_path), max_steps=2, save_steps=1)
    assert trainer.state.step == 2 and _metric_steps(tmp_path / "run") == [1, 2]


def test_second_run_into_a_locked_folder_is_refused(tmp_path, tiny):
    out = str(tmp_path / "run")
    with RunLock(out):
        model, tokenizer = tiny
        trainer = GRPOTrainer(config(tmp_path, max_steps=1), [target_fraction], rows(), model=model, tokenizer=tokenizer)
        with pytest.raises(RuntimeError, match=rf"in use by another run \(pid {os.getpid()}\)"):
            trainer.train()
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")), "the refused run wrote metrics"


def test_the_lock_dies_with_its_process(tmp_path):
    out = str(tmp_path / "run")
    code = f"from grpo_fast.run.folder import RunLock; import time; RunLock({out!r}).__enter__(); print('locked', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(RuntimeError, match="in use by another run"):
        RunLock(out).__enter__()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while True:  # the kernel drops the lock with the process's descriptors
        try:
            with RunLock(out):
                break
        except RuntimeError:
            assert time.time() < deadline, "the lock outlived the killed process"
            time.sleep(0.05)


@pytest.mark.parametrize("where", ["state", "shards"])
def test_full_disk_names_the_folder_and_size_and_leaves_no_temp_folder(tmp_path, tiny, monkeypatch, where):
    """The disk fills while checkpoint-2 is written: in its trainer state, or in the model and
    optimizer shards (inside torch.distributed.checkpoint, which wraps the error in its own)."""
    real_save, states = checkpoint.torch.save, []

    def save(obj, path, *args, **kwargs):
        if str(path).endswith(checkpoint.STATE_FILE):
            states.append(path)
        if len(states) == (2 if where == "state" else 1) and (where == "state") == isinstance(path, str):
            raise OSError(errno.ENOSPC, "No space left on device")  # ("shards": DCP saves into a buffer)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    with pytest.raises(OSError, match=r"no space left on .*run: writing checkpoint-2 needs about \d+ MiB"):
        _train(tmp_path, tiny, max_steps=3, save_steps=1)
    out = tmp_path / "run"
    assert sorted(os.listdir(out)) == [".lock", "checkpoint-1", "metrics.jsonl", "run_config.json", "tensorboard"]
    assert os.path.exists(out / "checkpoint-1" / checkpoint.STATE_FILE)


def test_stale_temp_folders_are_removed_at_the_next_start(tmp_path, tiny):
    _train(tmp_path, tiny, max_steps=1, save_steps=1)
    stale = tmp_path / "run" / ".tmp-checkpoint-2-99999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    _train(tmp_path, tiny, max_steps=2, save_steps=1, resume_from_checkpoint="latest")
    assert not stale.exists()


def test_final_model_is_written_atomically(tmp_path, tiny, monkeypatch):
    _train(tmp_path, tiny, max_steps=1)
    final = tmp_path / "run" / "final"
    before = (final / "model.safetensors").read_bytes()
    real_save_model = checkpoint.save_model

    def torn(model, tokenizer, folder, state_dict=None):
        real_save_model(model, tokenizer, folder, state_dict)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write('{"torn":')
        raise KeyboardInterrupt  # killed while writing

    monkeypatch.setattr(checkpoint, "save_model", torn)
    trainer = GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1], evaluate_only=True)
    with pytest.raises(KeyboardInterrupt):
        trainer._save(str(final), final=True)
    assert json.loads((final / "config.json").read_text())  # the old final/ is whole
    assert (final / "model.safetensors").read_bytes() == before
    assert not [n for n in os.listdir(tmp_path / "run") if n.startswith(".tmp-")]


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path, tiny, tiny_path, caplog):
    """What a kill inside the first checkpoint write leaves (metrics.jsonl with step 1, run_config.json,
    a temporary checkpoint folder, no checkpoint): a fresh start still refuses the folder, yet removes
    the temporary folder first; --resume trains from step 0, as the uninterrupted run does, once
    warned, without the killed attempt's metrics rows."""
    from tests.tiny_model import load_tiny_model

    def train(model_and_tokenizer, output_dir, **overrides):
        model, tokenizer = model_and_tokenizer
        c = config(tmp_path, output_dir=str(output_dir), **{"max_steps": 2, "save_steps": 0, "save_final": False, **overrides})
        GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
        return model

    whole = train(tiny, tmp_path / "whole")
    out = tmp_path / "run"
    train(load_tiny_model(tiny_path), out, max_steps=1)  # (save_steps=0: no checkpoint, as if killed in it)
    stale = out / ".tmp-checkpoint-1-99999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    assert _metric_steps(out) == [1] and not checkpoint.list_checkpoints(str(out))
    with pytest.raises(ValueError, match="already holds files"):
        GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1])
    assert not stale.exists(), "the refusal came before the temporary folder was removed"
    with caplog.at_level("WARNING", logger="grpo_fast"):
        resumed = train(load_tiny_model(tiny_path), out, resume_from_checkpoint="latest")
    warned = [r.getMessage() for r in caplog.records if "no checkpoint yet" in r.getMessage()]
    assert len(warned) == 1 and "resuming from step 0" in warned[0], warned
    assert _metric_steps(out) == _metric_steps(tmp_path / "whole") == [1, 2], "rows of the killed attempt kept"
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert p.equal(q), f"{name}: the run resumed from step 0 differs from the uninterrupted run"

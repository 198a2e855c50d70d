"""A run killed with kill -9 between checkpoints, then resumed: every tracker holds every step of metrics.jsonl
(a kill loses what a tracker had not written yet: wandb's offline file lags the run, trackio queues its logs), and
TensorBoard holds each step once. The run shows model text with rich markup and control bytes in it as data
(`--log_completions`: it ended the run, and its resume, at the same step). mlflow is not installed by the setup:
not covered here (its calls write through to its store, so a kill loses at most the one in progress)."""

import glob
import json
import os
import re
import signal

import numpy as np
import pytest

from tests.faults.conftest import fault_args, run
from tests.trainer.test_trackers import _trackio_logs, _wandb_history

pytestmark = pytest.mark.slow


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}


def test_kill9_between_checkpoints_then_resume_leaves_every_step_in_every_tracker(tmp_path, tiny_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("trackio")
    monkeypatch.setenv("WANDB_MODE", "offline")  # (the processes inherit the environment)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    # each process its own wandb service, as from a shell: a wandb run earlier in this pytest process leaves its
    # service's address in WANDB_SERVICE, and a killed attempt's run then stays "in use" in that shared service
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # rich's width where stdout is not a terminal: no cell cut short
    data = tmp_path / "prompts.jsonl"  # what rich reads as markup, and a byte a terminal acts on (short: 32 tokens)
    data.write_text("".join(json.dumps({"prompt": f"[/i]{i}[/INST]\x1b"}) + "\n" for i in range(24)))
    project, out = f"grpo-fast-tests-{os.getpid()}-{tmp_path.name}", tmp_path / "run"
    args = fault_args(tiny_path, str(data), out, "--save_steps", "2", "--report_to", "tensorboard,wandb,trackio",
                      "--project", project, "--log_completions", "--num_completions_to_print", "2")
    # killed after step 4 trained: step 3 was logged after checkpoint-2, step 4 not at all
    code, _, err = run(args, fault="after_step:4")
    assert code == -signal.SIGKILL, err
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    code, stdout, err = run([*args, "--resume"])
    assert code == 0, err
    table = [line for line in stdout.splitlines() if line.startswith("│")]  # (trackio colours its own lines)
    assert re.search(r"│ \[/i\]\d+\[/INST\]\\x1b +│", stdout) and not any("\x1b" in t for t in table), stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]

    # TensorBoard: each step once (the killed attempt's step 3 hidden: that step was trained again), as logged
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={SCALARS: 0})
    events.Reload()
    for record in records:
        for name, value in _scalars(record).items():
            held = [e.value for e in events.Scalars(name) if e.step == record["step"]]
            assert held == [np.float32(value)], (name, record["step"], held, value)
    assert {e.step for tag in events.Tags()[SCALARS] for e in events.Scalars(tag)} == {1, 2, 3, 4}

    # wandb (offline): an attempt's history is its own file; the resumed attempt's holds every step
    attempts = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(attempts) == 2 and len({a.rsplit("-", 1)[1] for a in attempts}) == 1, attempts  # one run id, resumed
    history = _wandb_history(attempts[-1])
    assert [step for step, _ in history] == [1, 2, 3, 4], (history, "killed attempt:", _wandb_history(attempts[0]))
    for (step, values), record in zip(history, records, strict=True):
        assert {k: values[k] for k in _scalars(record)} == _scalars(record), step

    # trackio: the run the checkpoint names holds every step; at each step its last values are metrics.jsonl's
    [(name, rows)] = _trackio_logs(project).values()
    assert name == "run"
    for record in records:
        last = {}
        for step, values in rows:
            if step == record["step"]:
                last.update(values)
        assert {k: last.get(k) for k in _scalars(record)} == _scalars(record), record["step"]

"""report_to: the values trackio and wandb keep in their own local stores equal metrics.jsonl's, step by
step (no mock tracker); a resumed run continues the same tracker runs; unknown values and missing trackers
are refused before work; log_completions shows the table of sampled completions with their rewards."""

import glob
import json
import math
import os
import struct

import pytest

from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import load_tiny_model
from tests.trainer.common import config, rows, target_fraction


def _train(tmp_path, tiny_path, **overrides):
    model, tokenizer = load_tiny_model(tiny_path)
    c = config(tmp_path, eval_before_train=False, save_final=False, **overrides)
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    lines = [json.loads(x) for x in open(os.path.join(c.output_dir, "metrics.jsonl"))]
    return c, [{k: v for k, v in r.items() if k != "time" and v is not None} for r in lines]


def _wandb_history(run_dir) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history record in wandb's offline transaction log (`run-<id>.wandb`:
    leveldb's log format, 32 KiB blocks of records [crc32, length, type] holding wandb Record protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data = open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb").read()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    out, pos, record = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk  # FULL, FIRST start a record; MIDDLE, LAST extend it
        if kind in (1, 4):
            r = wandb_internal_pb2.Record()
            r.ParseFromString(record)
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                out.append((r.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return out


def _same(read_back: dict, logged: dict, where: str):
    names = [k for k in logged if k != "step"]
    assert sorted(read_back) == sorted(names), (where, sorted(set(read_back) ^ set(names)))
    for name in names:
        assert math.isclose(read_back[name], logged[name], rel_tol=1e-12), (where, name, read_back[name], logged[name])


def test_trackio_and_wandb_keep_what_metrics_jsonl_has_and_a_resume_continues_their_runs(tmp_path, tiny_path,
                                                                                           monkeypatch):
    project = f"grpo-fast-tests-{os.getpid()}-{tmp_path.name}"  # this test's own trackio project
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    c, lines = _train(tmp_path, tiny_path, report_to="trackio,wandb", project=project, run_name="tracked",
                      max_steps=3, save_steps=2)
    # resume from checkpoint-2: step 3 again, into the same tracker runs
    _, resumed = _train(tmp_path, tiny_path, report_to="trackio,wandb", project=project, run_name="tracked",
                        max_steps=3, save_steps=2, resume_from_checkpoint="latest")
    assert [r["step"] for r in lines] == [1, 2, 3] and [r["step"] for r in resumed] == [1, 2, 3]

    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    assert str(trackio.utils.TRACKIO_DIR) == os.environ["TRACKIO_DIR"], "trackio writes into the suite's folder"
    assert SQLiteStorage.get_runs(project) == ["tracked"], "the resumed run continued the same trackio run"
    logs = [r for r in SQLiteStorage.get_logs(project, "tracked") if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 3], "trackio keeps both attempts at step 3"
    for got, want in zip(logs, [*lines, resumed[-1]], strict=True):
        _same({k: v for k, v in got.items() if k not in ("step", "timestamp")}, want, f"trackio step {want['step']}")

    runs = glob.glob(os.path.join(c.output_dir, "wandb", "offline-run-*"))
    assert len(runs) == 2 and len({r.rsplit("-", 1)[1] for r in runs}) == 1, f"one wandb run id, resumed: {runs}"
    first, second = sorted(runs)
    history = _wandb_history(first)
    assert [s for s, _ in history] == [1, 2, 3]
    for (step, got), want in zip(history, lines, strict=True):
        _same(got, want, f"wandb step {step}")
    # the resumed attempt logs step 3 again: wandb drops a step below its last one, and keeps an equal one
    assert [s for s, _ in _wandb_history(second)] == [3]


@pytest.mark.parametrize("value, match", [
    ("neptune", r"report_to='neptune' is not supported; expected a comma-separated list of \['tensorboard', 'wandb', "
                r"'trackio', 'mlflow'\], or 'none' or 'all' alone"),
    ("none,wandb", r"or 'none' or 'all' alone"),
    ("mlflow", r"report_to='mlflow' names \['mlflow'\] but it is not installed: pip install mlflow"),
])
def test_unknown_or_missing_trackers_are_refused_before_work(tmp_path, value, match):
    pytest.importorskip("wandb")
    if value == "mlflow" and __import__("importlib").util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here: its refusal needs it absent")
    with pytest.raises(ValueError, match=match):
        config(tmp_path, report_to=value)


def test_report_to_takes_trls_list_too(tmp_path):
    assert config(tmp_path, report_to=["tensorboard", "wandb"]).report_to == "tensorboard,wandb"


def test_log_completions_shows_each_completion_with_its_rewards(tmp_path, tiny_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich's width when the output is not a terminal: one line per row
    scored = []

    def recorded(prompts, completions, completion_ids, **columns):
        values = target_fraction(prompts, completions, completion_ids)
        scored.extend(zip(prompts, values, strict=True))
        return values

    recorded.__name__ = "target_fraction"
    lengths = []

    def length(prompts, completions, completion_ids, **columns):  # a second reward: a column of its own
        lengths.extend(float(len(ids)) for ids in completion_ids)
        return lengths[-len(completion_ids):]

    model, tokenizer = load_tiny_model(tiny_path)
    c = config(tmp_path, eval_before_train=False, save_final=False, max_steps=1, log_completions=True,
               num_completions_to_print=6, report_to="none", max_completion_length=4)
    GRPOTrainer(c, [recorded, length], rows(), model=model, tokenizer=tokenizer).train()
    out = capsys.readouterr().out
    assert "completions at step 1" in out
    header = next(line for line in out.splitlines() if "prompt" in line and "completion" in line)
    assert "target_fraction" in header and "length" in header and "advantage" in header
    shown = [line for line in out.splitlines() if line.startswith("│ question ")]
    assert len(shown) == 6, out
    import torch

    from grpo_fast import group_advantages

    total = torch.tensor([r for _, r in scored], dtype=torch.float64) + torch.tensor(lengths, dtype=torch.float64)
    advantages = group_advantages(total, num_generations=c.num_generations)  # what trained: the weighted sum's
    for k, (line, (prompt, reward)) in enumerate(zip(shown, scored[:6], strict=True)):  # the batch's first 6, in order
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[0] == prompt and cells[2] == f"{reward:.3f}" and cells[3] == f"{lengths[k]:.3f}", (cells, prompt, reward)
        # (the table prints 3 decimals: half a unit of the last one, whatever the magnitude, plus float noise)
        assert float(cells[4]) == pytest.approx(float(advantages[k]), abs=5e-4, rel=1e-6), (cells, float(advantages[k]))
    assert not os.path.exists(os.path.join(c.output_dir, "tensorboard")), "report_to=none writes no tracker files"

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
    # the resumed attempt's file holds every step: the ones before its checkpoint replayed from metrics.jsonl (an
    # offline attempt cannot know what the other files hold; `wandb sync` keeps the first of a step), then step 3
    assert [s for s, _ in _wandb_history(second)] == [1, 2, 3]
    for (step, got), want in zip(_wandb_history(second), resumed, strict=True):
        _same(got, want, f"wandb step {step}, resumed attempt")


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


# ---- issue 46: model text as data, the trackio run a checkpoint names, credentials before any work -------------

MODEL_TEXT = ("<s>[INST] 2+2? [/INST] [/i] [bold]four[/bold] :smile: \\boxed{4} e\x1b[31mred\x1b[0m bell\x07 nul\x00 "
              "cr\r del\x7f lone\ud800 rtl\u202eoverride\nsecond line")
SHOWN = ("<s>[INST] 2+2? [/INST] [/i] [bold]four[/bold] :smile: \\boxed{4} e\\x1b[31mred\\x1b[0m bell\\x07 nul\\x00 "
         "cr\\r del\\x7f lone\\ud800 rtl\\u202eoverride")  # (its first line: a table cell keeps the newline)


def _trackio_logs(project: str) -> dict:
    """id -> (name, [(step, values)]) of every run in `project`'s local trackio database."""
    from trackio.sqlite_storage import SQLiteStorage

    out = {}
    for run in SQLiteStorage.get_run_records(project):
        rows = SQLiteStorage.get_logs(project, run["name"], run_id=run["id"])
        out[run["id"]] = (run["name"], [(r["step"], {k: v for k, v in r.items() if k not in ("step", "timestamp")})
                                        for r in rows])
    return out


def test_completions_with_markup_and_control_bytes_are_shown_as_written_in_the_console_and_the_trackers(
        tmp_path, capsys, monkeypatch):
    """rich read `[/INST]` and `[/i]` as closing tags (MarkupError: the run died, and died again on resume at the
    same step), dropped `[bold]` and printed control bytes raw: model text is now shown as written, the bytes that
    would act on the terminal (or cannot be encoded) as their escapes, in the console and in the trackers' tables."""
    import torch

    from grpo_fast.distributed import ONE_PROCESS
    from grpo_fast.generation.batch import Rollouts
    from grpo_fast.reporting.completions_table import log_completions
    from grpo_fast.reporting.metrics import MetricsLogger, ProgressBar
    from grpo_fast.reporting.options import ReportOptions
    from grpo_fast.reporting.trackers import open_trackers

    monkeypatch.setenv("COLUMNS", "400")  # rich's width when the output is not a terminal
    project = f"grpo-fast-tests-{os.getpid()}-{tmp_path.name}"
    batch = Rollouts(prompt_ids=[[1], [1]], completion_ids=[[2], [3]], sampling_logp=[torch.zeros(1)] * 2,
                     finish_reason=["stop"] * 2, completion_texts=[MODEL_TEXT, "plain"],
                     rows=[{"prompt": MODEL_TEXT}, {"prompt": "[/INST]"}], rewards=torch.tensor([[1.0], [0.0]]),
                     advantages=torch.tensor([0.5, -0.5]))

    def score_in_brackets(prompts, completions, completion_ids, **columns):  # a header with brackets too
        return [0.0] * len(prompts)

    score_in_brackets.__name__ = "score[v2]"
    c = config(tmp_path, log_completions=True, report_to="trackio", project=project)
    logger = MetricsLogger(c.output_dir, trackers=open_trackers(ReportOptions.from_config(c), c.to_dict(), {}))
    capsys.readouterr()
    for bar in (ProgressBar(1, enabled=False), ProgressBar(1, enabled=True)):  # print() alone, and the live bar's console
        log_completions(batch, step=1, options=ReportOptions.from_config(c), prompt_column=c.prompt_column,
                        reward_funcs=[score_in_brackets], world=ONE_PROCESS, bar=bar, metrics_logger=logger)
        bar.close()
        out = capsys.readouterr().out
        cells = [[cell.strip() for cell in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│")]
        assert cells[0][:2] == [SHOWN, SHOWN], out  # prompt and completion, as written
        assert cells[1][:2] == ["second line", "second line"], out
        assert cells[2][:2] == ["[/INST]", "plain"], out
        assert "score[v2]" in out and "\x1b" not in out and "\x00" not in out and "😄" not in out, out
    logger.close()
    [(_, logs)] = _trackio_logs(project).values()
    table = [values["completions"] for _, values in logs if "completions" in values]
    assert len(table) == 2, logs  # (a lone surrogate made trackio drop the whole table)
    assert [table[0]["_value"][0]["prompt"], table[0]["_value"][0]["completion"]] == [SHOWN + "\nsecond line"] * 2


def test_a_resumed_trackio_run_continues_the_run_its_checkpoint_names_not_the_newest_run_of_that_name(tmp_path):
    """Runs in folders a/r and b/r have the same trackio name (the folder's basename): resuming a/r appended to b/r's
    run, the newest of that name. A resume now continues the run by the id its checkpoint saved."""
    from grpo_fast.reporting.options import ReportOptions
    from grpo_fast.reporting.trackers import close_all, open_trackers

    project = f"grpo-fast-tests-{os.getpid()}-{tmp_path.name}"
    a, b = (config(tmp_path, output_dir=str(tmp_path / folder / "r"), report_to="trackio", project=project)
            for folder in "ab")

    def attempt(c, runs, steps, base):
        trackers = open_trackers(ReportOptions.from_config(c), c.to_dict(), runs)
        for step in steps:
            trackers[0].log(step, {"loss": base + step})
        close_all(trackers)

    runs_a, runs_b = {}, {}
    attempt(a, runs_a, [1, 2], 10.0)  # a/r trains 2 steps (its checkpoint keeps runs_a)
    attempt(b, runs_b, [1, 2, 3], 20.0)  # b/r starts later: the newest trackio run named "r"
    attempt(a, dict(runs_a), [3], 10.0)  # a/r resumed from its checkpoint
    logs = sorted([values["loss"] for _, values in rows] for _, rows in _trackio_logs(project).values())
    assert logs == [[11.0, 12.0, 13.0], [21.0, 22.0, 23.0]], "a/r's step 3 went to its own run, b/r's is untouched"
    assert [name for name, _ in _trackio_logs(project).values()] == ["r", "r"]


def _no_wandb_login(tmp_path, monkeypatch):
    """An environment where wandb would log online and has no API key anywhere."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # the .netrc wandb reads: no machine in it
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no global settings file
    monkeypatch.chdir(tmp_path)  # no workspace settings (./wandb/settings)


def test_online_wandb_without_a_login_is_refused_in_one_line_before_any_work(tmp_path, tiny_path, monkeypatch, capsys):
    """It failed after the model loaded, with a 46-line traceback, leaving run_config.json (so the same command was
    then refused): the login is checked first, and the output folder is never created."""
    pytest.importorskip("wandb")
    from grpo_fast.cli import main

    _no_wandb_login(tmp_path, monkeypatch)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    argv = ["train", "--report_to", "tensorboard,wandb", "--output_dir", str(out), "--model", tiny_path, "--engine",
            "hf", "--dataset", str(data), "--reward_funcs", "tests.trainer.common:target_fraction", "--max_steps", "1",
            "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_completion_length", "4",
            "--disable_tqdm"]
    for ranks in ([], ["--nproc_per_node", "2"]):  # (one process; the launcher, before torchrun starts a rank)
        assert main(argv + ranks) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "report_to='tensorboard,wandb': wandb logs online" in err \
            and "wandb login" in err and "WANDB_MODE=offline" in err, err
        assert not out.exists(), "nothing is written before the check (run_config.json made the rerun refused)"


def test_tracker_credentials_found_where_wandb_and_trackio_look(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from grpo_fast.reporting.trackers import check_credentials

    _no_wandb_login(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"^report_to='wandb': wandb logs online \(to https?://\S+\) but finds no API "):
        check_credentials("wandb")
    check_credentials("tensorboard,trackio")  # local: nothing to log in to
    key = "0123456789abcdef" * 3
    monkeypatch.setenv("WANDB_API_KEY", key)
    check_credentials("wandb")
    monkeypatch.delenv("WANDB_API_KEY")
    import wandb

    host = __import__("urllib.parse").parse.urlsplit(wandb.Settings().base_url).netloc
    (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password {key}\n")  # what `wandb login` writes
    check_credentials("wandb")
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_credentials("wandb")
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/a-space")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if __import__("huggingface_hub").get_token() is None:  # (this machine holds no Hugging Face login)
        with pytest.raises(ValueError, match=r"TRACKIO_SPACE_ID='someone/a-space' logs to a Hugging Face Space, which "
                                             r"needs a Hugging Face login"):
            check_credentials("trackio")
    monkeypatch.delenv("TRACKIO_SPACE_ID")
    monkeypatch.setenv("TRACKIO_SERVER_URL", "http://127.0.0.1:7860/")
    with pytest.raises(ValueError, match=r"TRACKIO_SERVER_URL='http://127.0.0.1:7860/' needs a write token"):
        check_credentials("trackio")
    monkeypatch.setenv("TRACKIO_WRITE_TOKEN", "secret")
    check_credentials("trackio")

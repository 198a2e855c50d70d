"""The grpo-fast command line: options from GRPOConfig, precedence, errors before any work."""

import pytest

from grpo_fast.cli import build_parser, config_from_args, main
from grpo_fast.config import GRPOConfig, field_names
from grpo_fast.data.inputs import InputOptions, load_datasets


def _config(argv):
    parser = build_parser()
    return config_from_args(parser.parse_args(argv))


def test_help_lists_every_field_with_its_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in field_names():
        assert f"--{name}" in out, f"--{name} missing from grpo-fast train --help"
    assert "Completions sampled per prompt" in out


def test_yaml_then_command_line_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 2.0e-6\nmax_steps: 50\nengine: hf\n")
    c = _config(["train", "--config", str(path), "--max_steps", "7", "--reward_funcs", "math,format",
                 "--epsilon_high", "0.28", "--mask_truncated_completions", "--delta", "none"])
    assert (c.learning_rate, c.max_steps, c.engine) == (2e-6, 7, "hf")
    assert c.reward_funcs == ["math", "format"] and c.epsilon_high == 0.28
    assert c.mask_truncated_completions is True and c.delta is None
    assert _config(["train"]) == GRPOConfig()  # no arguments: the default run
    assert _config(["train", "--resume"]).resume_from_checkpoint == "latest"


def test_unknown_option_lists_close_matches(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--num_generation", "4"])
    assert "did you mean --num_generations" in capsys.readouterr().err


def test_invalid_value_is_reported_before_any_work(capsys):
    assert main(["train", "--loss_type", "ppo"]) == 2
    assert "GRPOConfig.loss_type='ppo' is invalid" in capsys.readouterr().err


def test_missing_and_malformed_dataset_files_name_path_and_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_datasets(InputOptions.from_config(GRPOConfig(dataset=str(missing))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        load_datasets(InputOptions.from_config(GRPOConfig(dataset=str(bad))))


def test_builtin_task_has_disjoint_held_out_split():
    train, held_out = load_datasets(InputOptions.from_config(GRPOConfig(task_train_size=300, eval_max_samples=50)))
    assert len(train) == 300 and len(held_out) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}


def test_train_then_eval_from_the_command_line(tmp_path, tiny_path, capsys):
    import json

    out = tmp_path / "run"
    argv = ["--model", tiny_path, "--engine", "hf", "--max_steps", "1", "--output_dir", str(out), "--num_generations", "4",
            "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--eval_max_samples", "4",
            "--task_train_size", "8", "--disable_tqdm"]
    assert main(["train", *argv]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and [s for s, _ in summary["eval_history"]] == [0, 1]
    assert "held-out accuracy" in capsys.readouterr().out
    assert main(["eval", *argv[:2], "--model", str(out / "final"), "--engine", "hf", "--eval_max_samples", "4",
                 "--max_completion_length", "8"]) == 0
    assert "eval/accuracy" in json.loads(capsys.readouterr().out)

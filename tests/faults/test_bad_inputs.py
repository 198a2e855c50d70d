"""Bad inputs are refused with one line naming the input, before any work; a run without a training
signal says so and stops; smaller user-facing failures of the CLI."""

import json
import math
import os

import pytest

from grpo_fast import models
from grpo_fast.cli import main
from grpo_fast.config import GRPOConfig
from grpo_fast.rewards import math_reward
from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import build_tiny_model
from tests.trainer.common import config, rows, target_fraction


def test_numeric_strings_are_numbers_in_yaml_and_in_the_constructor(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: '7'\n")  # PyYAML reads 1e-5 as the string '1e-5'
    c = GRPOConfig.from_yaml(path)
    assert (c.learning_rate, c.max_steps) == (1e-5, 7)
    assert GRPOConfig(learning_rate="3e-6").learning_rate == 3e-6
    with pytest.raises(ValueError, match=r"GRPOConfig\.learning_rate='fast' is invalid"):
        GRPOConfig(learning_rate="fast")


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("short"), max_position_embeddings=256)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_context_budget_is_checked_before_the_model_loads(tmp_path, short_context_model, monkeypatch, engine):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    c = config(tmp_path, model=short_context_model, engine=engine, max_prompt_length=256, max_completion_length=64,
               max_tokens_per_microbatch=None)
    with pytest.raises(ValueError, match=r"max_prompt_length \(256\) \+ max_completion_length \(64\) = 320 tokens "
                                         r"exceeds the model's context of 256"):
        GRPOTrainer(c, [target_fraction], rows())


def test_context_of_unbounded_prompts_is_checked_on_the_encoded_prompts(tmp_path, short_context_model):
    from tests.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(short_context_model)
    long_rows = rows(4) + [{"prompt": "x" * 300}]
    with pytest.raises(ValueError, match=r"row 4's prompt has \d+ tokens.*context of 256"):
        GRPOTrainer(config(tmp_path, max_prompt_length=None), [target_fraction], long_rows, model=model, tokenizer=tokenizer)


def test_empty_prompt_is_refused_at_load_naming_the_row(tmp_path, tiny):
    bad = rows(6)
    bad[4]["prompt"] = "   "
    with pytest.raises(ValueError, match=r"train_dataset: row 4, column 'prompt': the prompt is empty"):
        GRPOTrainer(config(tmp_path), [target_fraction], bad, model=tiny[0], tokenizer=tiny[1])


def test_reward_columns_are_checked_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    no_answers = [{"prompt": f"question {i}"} for i in range(8)]
    with pytest.raises(ValueError, match=r"reward function 'math' reads the column\(s\) \['answer'\], which train_dataset"):
        GRPOTrainer(config(tmp_path, model="unused"), [math_reward], no_answers)

    def needs_solution(prompts, completions, completion_ids, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'needs_solution' reads the column\(s\) \['solution'\]"):
        GRPOTrainer(config(tmp_path, model="unused"), [needs_solution], rows())


def test_no_training_signal_warns_then_stops(tmp_path, tiny, capsys):
    def no_reward(prompts, completions, completion_ids, **kwargs):
        return [None] * len(completions)

    c = config(tmp_path, max_steps=10, max_signal_free_steps=3, eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [no_reward], rows(), model=tiny[0], tokenizer=tiny[1])
    with pytest.raises(RuntimeError, match=r"no training signal for 3 steps in a row \(max_signal_free_steps=3\)"):
        trainer.train()
    assert trainer.state.step == 3
    assert capsys.readouterr().out.count("had no training signal (every reward was None or non-finite") == 3


def test_skipped_steps_count_as_no_signal(tmp_path, tiny, monkeypatch):
    import grpo_fast.train.step as step_module

    real = step_module.fused_linear_grpo_loss
    monkeypatch.setattr(step_module, "fused_linear_grpo_loss",
                        lambda *a, **k: (lambda out: (out[0] * math.nan, out[1]))(real(*a, **k)))
    c = config(tmp_path, max_steps=5, max_signal_free_steps=2, eval_before_train=False, save_final=False)
    with pytest.raises(RuntimeError, match="no training signal for 2 steps"):
        GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1]).train()


def test_resume_at_max_steps_says_so_and_writes_nothing(tmp_path, tiny, capsys):
    c = config(tmp_path, max_steps=2, save_steps=2, eval_steps=0, save_final=False)
    GRPOTrainer(c, [target_fraction], rows(), eval_dataset=rows(4), model=tiny[0], tokenizer=tiny[1]).train()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    c = config(tmp_path, max_steps=1, resume_from_checkpoint="latest", save_final=False)
    GRPOTrainer(c, [target_fraction], rows(), eval_dataset=rows(4), model=tiny[0], tokenizer=tiny[1]).train()
    assert "is at step 2 >= max_steps=1: nothing to train" in capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # no duplicate eval row


def test_resume_without_a_checkpoint_fails_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(FileNotFoundError, match="no checkpoint-"):
        GRPOTrainer(config(tmp_path, model="unused", resume_from_checkpoint="latest"), [target_fraction], rows())


def test_cli_user_errors_are_one_line_and_version_exists(tmp_path, capsys):
    assert main(["train", "--dataset", str(tmp_path / "missing.jsonl"), "--output_dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.jsonl" in err and "--debug" in err
    with pytest.raises(FileNotFoundError):
        main(["train", "--debug", "--dataset", str(tmp_path / "missing.jsonl"), "--output_dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("grpo-fast ")


def scaled_reward(prompts, completions, completion_ids, **kwargs):
    """Not a 0/1 correctness score: 2.5 for every completion (and a spread, so groups differ)."""
    return [2.5 + 0.01 * (len(ids) % 3) for ids in completion_ids]


def test_summary_line_is_no_percentage_for_a_non_binary_reward(tmp_path, tiny_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", tiny_path, "--engine", "hf", "--max_steps", "1", "--output_dir", str(out),
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
            "--eval_max_samples", "4", "--task_train_size", "8", "--disable_tqdm",
            "--reward_funcs", "tests.faults.test_bad_inputs:scaled_reward"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("held-out mean of the first reward"))
    assert "%" not in line and "2.5" in line, line
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert os.path.isdir(out / "final")

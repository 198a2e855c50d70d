"""A resumed run is the same run: options not given come from the run's saved config, a given option that
differs is refused in one line before any model loads (run control and layout excepted), and an explicit
`resume_override` takes effect."""

import json
import os
import shutil

import pytest
import torch

from grpo_fast import models
from grpo_fast.cli import build_parser, config_from_args, main
from grpo_fast.run import checkpoint
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction

REWARD = "tests.trainer.common:target_fraction"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_path):
    """A finished 1-step cispo run with an entropy bonus and a custom reward, checkpoint-1 in it."""
    from tests.tiny_model import load_tiny_model

    out = tmp_path_factory.mktemp("resume") / "run"
    model, tokenizer = load_tiny_model(tiny_path)
    c = config(out.parent, model=tiny_path, output_dir=str(out), loss_type="cispo", entropy_coef=0.3,
               reward_funcs=[REWARD], max_steps=1, save_steps=1, save_final=False, eval_before_train=False)
    torch.set_num_threads(1)
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    return out


def _edited(path, saved):
    """trainer_state.pt rewritten by hand: without the manifest that would now call it damaged (its size
    changed), as a checkpoint of an earlier version."""
    torch.save(saved, path)
    (path.parent / checkpoint.MANIFEST).unlink()


def _resume_config(out, *argv):
    return config_from_args(build_parser().parse_args(["train", "--output_dir", str(out), "--resume", *argv]))


def test_options_not_given_come_from_the_saved_run(run_dir, tiny_path):
    c = _resume_config(run_dir, "--max_steps", "3")
    assert (c.loss_type, c.entropy_coef, c.reward_funcs, c.model) == ("cispo", 0.3, [REWARD], tiny_path)
    assert c.max_steps == 3 and c.resume_from_checkpoint == "latest"
    assert json.loads((run_dir / "run_config.json").read_text())["loss_type"] == "cispo"


@pytest.mark.parametrize("option, value, shown", [
    ("loss_type", "dapo", "loss_type: 'cispo' -> 'dapo'"),
    ("reward_funcs", "math", f"reward_funcs: ['{REWARD}'] -> ['math']"),
    ("learning_rate", "0.001", "learning_rate: 0.03 -> 0.001"),
    ("max_completion_length", "4", "max_completion_length: 8 -> 4"),
    ("num_generations", "8", "num_generations: 4 -> 8"),
])
def test_a_changed_option_is_refused_in_one_line_before_the_model_loads(run_dir, option, value, shown, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    assert main(["train", "--output_dir", str(run_dir), "--resume", f"--{option}", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and shown in err and f"--resume_override {option}" in err, err


def test_groups_in_flight_pin_their_options_even_against_an_override(run_dir, tmp_path, capsys):
    out = tmp_path / "partial"
    shutil.copytree(run_dir, out)
    path = out / "checkpoint-1" / "trainer_state.pt"
    saved = torch.load(path, weights_only=False)
    saved["config"].update(engine="auto", max_staleness=1)
    saved["state"]["in_flight"] = [{"prompt": 0, "members": []}]  # what a partial-rollout checkpoint carries
    _edited(path, saved)
    assert _resume_config(out).max_staleness == 1  # taken from the run
    for argv in (["--max_staleness", "0"], ["--max_completion_length", "4"], ["--num_generations", "8"]):
        code = main(["train", "--output_dir", str(out), "--resume", *argv, "--resume_override", argv[0][2:]])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "groups in flight" in err and argv[0][2:] in err, err


def test_the_trainer_refuses_a_changed_config_from_python_too(run_dir, tiny_path, monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    c = config(run_dir.parent, model=tiny_path, output_dir=str(run_dir), loss_type="dapo", entropy_coef=0.3,
               reward_funcs=[REWARD], resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match=r"loss_type: 'cispo' -> 'dapo'"):
        GRPOTrainer(c, [target_fraction], rows())


def test_an_override_reaches_the_optimizer_and_the_log(run_dir, tmp_path, tiny_path):
    from tests.tiny_model import load_tiny_model

    out = tmp_path / "override"
    shutil.copytree(run_dir, out)
    c = _resume_config(out, "--max_steps", "2", "--learning_rate", "0.001", "--resume_override", "learning_rate")
    assert c.learning_rate == 0.001 and c.loss_type == "cispo"
    model, tokenizer = load_tiny_model(tiny_path)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    trainer.train()
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["learning_rate"] for r in logged if "loss" in r] == [0.03, 0.001]
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.001]
    saved = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert saved["config"]["learning_rate"] == 0.001
    # the override was this resume's: the next resume keeps the new rate without naming it again
    assert _resume_config(out, "--max_steps", "3").learning_rate == 0.001
    assert os.path.exists(out / "run_config.json")


def test_resume_override_needs_a_resume_and_known_names(tmp_path):
    with pytest.raises(ValueError, match="resume_override.*--resume"):
        config(tmp_path, resume_override=["learning_rate"])
    with pytest.raises(ValueError, match="unknown: \\['learning_rat'\\]"):
        config(tmp_path, resume_override=["learning_rat"], resume_from_checkpoint="latest")


@pytest.mark.filterwarnings("ignore:lora_r=4 has no effect without use_peft")  # (use_peft false: what it says)
@pytest.mark.parametrize("argv, shown", [
    (["--lora_target_modules", "q_proj"], "lora_target_modules: ['all-linear'] -> ['q_proj']"),
    (["--lora_r", "8"], "lora_r: 4 -> 8"),
    (["--use_peft", "false"], "use_peft: True -> False"),
])
def test_an_override_that_cannot_apply_to_a_saved_adapter_is_refused_in_one_line_before_the_model_loads(
        run_dir, tmp_path, argv, shown, monkeypatch, capsys):
    """A LoRA checkpoint (the run's, marked as one: no trainer run needed) resumed with another adapter shape: its
    tensors would not be the new model's (loaded non-strictly, 24 of 28 were dropped; use_peft and lora_r ended in
    tracebacks)."""
    out = tmp_path / "lora"
    shutil.copytree(run_dir, out)
    path = out / "checkpoint-1" / "trainer_state.pt"
    saved = torch.load(path, weights_only=False)
    saved["config"].update(use_peft=True, lora_r=4, lora_target_modules=["all-linear"])
    _edited(path, saved)
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    code = main(["train", "--output_dir", str(out), "--resume", *argv, "--resume_override", argv[0][2:]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "holds a LoRA adapter (r=4 on ['all-linear'])" in err and shown in err and "cannot apply" in err, err
    # the same from Python
    c = config(out.parent, model=tiny_path_of(saved), output_dir=str(out), loss_type="cispo", entropy_coef=0.3,
               reward_funcs=[REWARD], resume_from_checkpoint="latest", use_peft=True, lora_r=4,
               lora_target_modules=["q_proj"], resume_override=["lora_target_modules"])
    with pytest.raises(ValueError, match=r"holds a LoRA adapter .* cannot apply to it"):
        GRPOTrainer(c, [target_fraction], rows())


def tiny_path_of(saved):
    return saved["config"]["model"]


def test_a_corrupt_run_config_is_named(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_config.json").write_text('{"loss_type": "cispo",')  # torn
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    assert main(["train", "--output_dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / "run_config.json") in err and "fix or delete" in err, err

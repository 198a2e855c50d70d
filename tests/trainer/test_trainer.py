"""GRPOTrainer end to end on a tiny random Llama with the HF engine."""

import copy
import json
import math
import os

import pytest
import torch

from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction

TRL_NAMES = [
    "reward", "reward_std", "rewards/target_fraction/mean", "frac_reward_zero_std", "completions/mean_length",
    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "kl", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "learning_rate", "grad_norm",
    "tokens_per_second", "step_time", "time/generate", "time/reward", "time/logprob", "time/train",
    "time/weight_sync", "rewards/non_finite", "skipped_steps", "sampling/logp_diff_mean",
]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_full_steps_write_metrics_plot_and_tensorboard(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=2, beta=0.04, num_iterations=2, save_final=True)
    trainer = GRPOTrainer(c, [target_fraction], rows(), eval_dataset=rows(8), model=model, tokenizer=tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    records = _records(c.output_dir)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for name in TRL_NAMES:
        assert name in steps[-1], f"metric {name!r} missing from metrics.jsonl"
    assert steps[-1]["kl"] is not None and steps[-1]["kl"] >= 0  # beta > 0: a reference exists
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert os.path.exists(os.path.join(c.output_dir, "reward.png"))
    assert any(f.startswith("events") for f in os.listdir(os.path.join(c.output_dir, "tensorboard")))
    assert os.path.exists(os.path.join(c.output_dir, "final", "model.safetensors"))
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 0, "two optimizer steps left every weight unchanged"


def test_reward_rises_on_learnable_reward(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=10, eval_before_train=False, save_final=False)
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    rewards = [r["reward"] for r in _records(c.output_dir) if "reward" in r]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, f"mean reward did not rise: first steps {rewards[:3]}, last steps {rewards[-3:]}"


def test_resume_equals_uninterrupted_run(tmp_path, tiny_path):
    from tests.tiny_model import load_tiny_model

    def run(out, max_steps, resume=None):
        model, tokenizer = load_tiny_model(tiny_path)
        c = config(tmp_path, output_dir=str(tmp_path / out), max_steps=max_steps, save_steps=2,
                   save_final=False, resume_from_checkpoint=resume, eval_before_train=False)
        GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
        return model, [r for r in _records(c.output_dir) if "reward" in r]

    whole_model, whole = run("whole", 4)
    run("split", 2)  # stops after step 2, checkpoint-2 written
    assert os.path.isdir(tmp_path / "split" / "checkpoint-2")
    resumed_model, resumed = run("split", 4, resume="latest")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed, strict=True):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"], (a, b)
    for (name, p), q in zip(whole_model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs between the uninterrupted and the resumed run"


def test_nonfinite_loss_skips_step_and_keeps_weights(tmp_path, tiny, monkeypatch):
    import grpo_fast.train.step as step_module

    model, tokenizer = tiny
    real = step_module.fused_linear_grpo_loss
    monkeypatch.setattr(step_module, "fused_linear_grpo_loss",
                        lambda *a, **k: (lambda out: (out[0] * math.nan, out[1]))(real(*a, **k)))
    c = config(tmp_path, max_steps=1, eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed although the loss was NaN"
    assert trainer.optimizer.state == {} or all(not s for s in trainer.optimizer.state.values())
    record = [r for r in _records(c.output_dir) if "reward" in r][-1]
    assert record["skipped_steps"] == 1 and record["loss"] is None


def test_dynamic_sampling_fills_batch_with_informative_groups(tmp_path, tiny):
    model, tokenizer = tiny
    calls = {"n": 0}

    def half_constant(prompts, completions, completion_ids, answer, **_):
        # rows with an even answer give every completion the same reward: a zero-std group
        calls["n"] += 1
        return [1.0 if int(a) % 2 == 0 else float(len(ids) % 3) for a, ids in zip(answer, completion_ids, strict=True)]

    c = config(tmp_path, max_steps=1, dynamic_sampling=True, eval_before_train=False, save_final=False,
               reward_funcs=["half_constant"])
    trainer = GRPOTrainer(c, [half_constant], rows(), model=model, tokenizer=tokenizer)
    trainer.train()
    record = [r for r in _records(c.output_dir) if "reward" in r][-1]
    assert record["frac_reward_zero_std"] > 0.2  # measured over every sampled group
    assert record["dynamic_sampling/rounds"] >= 2 and calls["n"] == record["dynamic_sampling/rounds"]
    assert record["frac_reward_zero_std_step"] <= record["frac_reward_zero_std"]


def test_prompt_over_max_length_errors_when_configured(tmp_path, tiny):
    model, tokenizer = tiny
    long_rows = [{"prompt": "x" * 200}] * 4
    with pytest.raises(ValueError, match="max_prompt_length"):
        GRPOTrainer(config(tmp_path, prompt_truncation="error"), [target_fraction], long_rows, model=model, tokenizer=tokenizer)
    trainer = GRPOTrainer(config(tmp_path), [target_fraction], long_rows, model=model, tokenizer=tokenizer)
    assert max(map(len, trainer.train_prompt_ids)) == 32  # cut from the left to max_prompt_length


@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_auto_precisions_follow_the_cpu_features(monkeypatch, bf16_hardware):
    """mixed_precision / vllm_dtype 'auto': bf16 on a CPU with bf16 matmul hardware, float32 on one
    without; CUDA keeps its bf16 weights without autocast; explicit settings win; the IS correction
    defaults on as soon as either side computes below float32."""
    from grpo_fast.config import GRPOConfig
    from grpo_fast.models import precision
    from grpo_fast.models.precision import Precision, default_is_correction

    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: bf16_hardware)
    cpu_dtype = torch.bfloat16 if bf16_hardware else torch.float32
    default = Precision.from_config(GRPOConfig())
    assert default.amp_dtype(cuda=False) == (torch.bfloat16 if bf16_hardware else None)
    assert default.engine_dtype(cuda=False) == cpu_dtype
    assert default.amp_dtype(cuda=True) is None and default.engine_dtype(cuda=True) == torch.bfloat16
    assert Precision.from_config(GRPOConfig(dtype="bfloat16")).amp_dtype(cuda=False) is None  # bf16 weights: nothing to autocast
    pinned = Precision.from_config(GRPOConfig(mixed_precision="no", vllm_dtype="float32"))
    assert pinned.amp_dtype(cuda=False) is None and pinned.engine_dtype(cuda=False) == torch.float32
    assert Precision.from_config(GRPOConfig(mixed_precision="bf16")).amp_dtype(cuda=False) == torch.bfloat16
    assert default_is_correction(cpu_dtype, default.amp_dtype(cuda=False) or torch.float32, 0) == bf16_hardware
    assert not default_is_correction(torch.float32, torch.float32, 0)
    assert default_is_correction(torch.float32, torch.bfloat16, 0)  # autocast alone differs from the engine
    assert default_is_correction(torch.float32, torch.float32, 1)  # stale tokens


def test_mixed_precision_bf16_runs_decoder_in_bf16_keeps_weights_fp32(tmp_path, tiny):
    model, tokenizer = tiny
    seen = set()
    layer = next(m for name, m in model.named_modules() if name.endswith("q_proj"))
    layer.register_forward_hook(lambda mod, args, out: seen.add((out.dtype, torch.is_grad_enabled())))
    c = config(tmp_path, max_steps=1, mixed_precision="bf16", eval_before_train=False, save_final=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    assert (torch.bfloat16, True) in seen, f"the training forward did not run under bf16 autocast: {seen}"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()) > 0
    record = [r for r in _records(c.output_dir) if "reward" in r][-1]
    assert record["skipped_steps"] == 0 and math.isfinite(record["loss"])


@pytest.mark.parametrize("hardware", [False, True])
def test_bf16_on_a_cpu_that_would_emulate_it_warns(tmp_path, tiny, monkeypatch, hardware):
    import warnings

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    model, tokenizer = tiny
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        GRPOTrainer(config(tmp_path, mixed_precision="bf16"), [target_fraction], rows(), model=model, tokenizer=tokenizer)
    emulated = [w for w in seen if "without bf16 matmul hardware" in str(w.message)]
    assert len(emulated) == (0 if hardware else 1), [str(w.message) for w in seen]
    if not hardware:
        assert "mixed_precision='bf16'" in str(emulated[0].message)


def test_adaptive_entropy_bonus_state_is_logged_and_checkpointed(tmp_path, tiny):
    """TRL's adaptive controller in the native trainer: no bonus in the first step (previous entropy
    +inf), the coefficient moves each step, and coefficient and last entropy are in the checkpoint."""
    from grpo_fast.run import checkpoint

    model, tokenizer = tiny
    c = config(tmp_path, max_steps=2, loss_type="cispo", epsilon_high=5.0, use_adaptive_entropy=True,
               entropy_coef=0.05, entropy_coef_delta=0.01, entropy_target=100.0, top_entropy_quantile=0.8,
               save_steps=2, eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    trainer.train()
    steps = [r for r in _records(c.output_dir) if "reward" in r]
    assert [r["entropy_coef"] for r in steps] == pytest.approx([0.06, 0.07])  # entropy < target: up each step
    assert steps[0]["policy_loss"] == pytest.approx(steps[0]["loss"], rel=1e-5)  # first step: no bonus applied
    assert "cispo_clip_ratio" in steps[-1] and "clip_ratio/region_mean" not in steps[-1]
    saved = checkpoint.load_trainer_state(os.path.join(c.output_dir, "checkpoint-2"))["state"]
    assert saved["entropy_coef"] == pytest.approx(0.07)
    assert 0 < saved["last_entropy"] < 100.0 and saved["last_entropy"] == trainer.state.last_entropy


@pytest.mark.parametrize("engine_dtype, expected", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_is_correction_default_follows_the_engines_dtype(tmp_path, tiny, engine_dtype, expected):
    """A float32 policy sampled by an engine of its own in bf16: the sampler's log-probs differ, IS on."""
    from grpo_fast.generation.engines import HFEngine

    model, tokenizer = tiny
    engine = HFEngine(copy.deepcopy(model).to(engine_dtype), tokenizer)
    trainer = GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=model, tokenizer=tokenizer, engine=engine)
    assert not trainer.engine_shares_weights and trainer.use_is == expected


@pytest.mark.parametrize("overrides, logged, with_rollout", [
    (dict(num_iterations=2), [1, 2], [1]),  # μ = 2: the round's two steps; its sampling figures on the first
    (dict(steps_per_generation=2, logging_steps=2), [2], [2]),  # the first step unlogged: on the first logged one
], ids=["iterations2", "steps_per_generation2-logging_steps2"])
def test_a_rounds_rollout_figures_are_logged_once(tmp_path, tiny, overrides, logged, with_rollout):
    """rollout/* figures describe a generation round: logged with the first logged optimizer step of
    the round, so that summed over a run's lines they count each round once."""
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=2, eval_before_train=False, save_final=False, per_device_train_batch_size=8,
               **overrides)
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    lines = _records(c.output_dir)
    assert [r["step"] for r in lines] == logged
    assert [r["step"] for r in lines if any(k.startswith("rollout/") for k in r)] == with_rollout
    assert all("reward" in r and "frac_reward_zero_std" in r for r in lines), "the round's other figures stay on every line"
    if "num_iterations" in overrides:  # one slice trained twice: the first line's completions are the round's
        assert lines[0]["rollout/generated_tokens"] == lines[0]["completions/mean_length"] * 8

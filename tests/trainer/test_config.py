"""GRPOConfig validation: errors name the field, the value and what is allowed."""

import pytest

from grpo_fast.config import GRPOConfig, field_names


def test_every_field_has_help():
    import dataclasses

    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata.get("help"), f"GRPOConfig.{f.name} has no help text"


@pytest.mark.parametrize("field, value, allowed", [
    ("loss_type", "ppo", "one of \\['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'vespo', 'luspo'\\]"),
    ("top_entropy_quantile", 0.0, "a number in \\(0, 1\\]"),
    ("sapo_temperature_neg", -1.0, "a positive finite number"),
    ("entropy_coef_min", 2.0, "<= entropy_coef_max"),
    ("num_generations", 1, "a baseline"),
    ("temperature", 0.0, "positive finite"),
    ("engine", "sglang", "one of"),
    ("per_device_train_batch_size", 10, "multiple of num_generations"),
    ("delta", 0.5, "> 1"),
    ("max_steps", "ten", "type int"),
    ("vllm_importance_sampling_mode", "seq", "sequence_mask"),
    ("max_tokens_per_microbatch", 16, "one sequence must fit"),
])
def test_invalid_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}={value!r} is invalid: expected .*{allowed}"):
        GRPOConfig(**{field: value})


def test_yaml_unknown_key_lists_close_matches(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rat: 1.0e-5\nnum_generation: 4\n")
    with pytest.raises(ValueError, match=r"'learning_rat' \(did you mean 'learning_rate'") as err:
        GRPOConfig.from_yaml(path)
    assert "num_generations" in str(err.value) and str(path) in str(err.value)


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 2.0e-6\nreward_funcs: [math]\nbeta: 0.1\n")
    c = GRPOConfig.from_yaml(path, max_steps=3)
    assert (c.learning_rate, c.reward_funcs, c.beta, c.max_steps) == (2e-6, ["math"], 0.1, 3)
    assert len(field_names()) > 50


def test_vespo_needs_a_token_level_is_mode_and_trl_warnings_are_kept():
    """As TRL: vespo folds per-token IS ratios into its weight, so the default sequence_mask mode is an
    error naming both options; luspo without sequence level warns."""
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode='sequence_mask'.*loss_type='vespo'.*"
                                         r"vllm_importance_sampling_correction=False"):
        GRPOConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    assert GRPOConfig(loss_type="vespo").is_mode == "token_mask"  # the default mode: vespo's token-level one
    assert GRPOConfig().is_mode == "sequence_mask"  # TRL's default elsewhere
    GRPOConfig(loss_type="vespo", vllm_importance_sampling_mode="token_truncate")
    GRPOConfig(loss_type="vespo", vllm_importance_sampling_correction=False)
    with pytest.warns(UserWarning, match="luspo.*sequence"):
        GRPOConfig(loss_type="luspo")
    with pytest.warns(UserWarning, match="sequence.*dapo.*length"):
        GRPOConfig(loss_type="dapo", importance_sampling_level="sequence")


def test_options_this_configuration_never_reads_warn_by_name():
    with pytest.warns(UserWarning, match=r"rollout_overprovision=1.0 has no effect with max_staleness=0"):
        GRPOConfig(rollout_overprovision=1.0)



def test_the_emulated_bf16_warning_leaves_out_an_engine_that_is_not_used(tiny, recwarn, monkeypatch):
    from grpo_fast.generation.engines import may_read
    from grpo_fast.models import precision

    def warn(c):
        precision.warn_emulated_bf16(precision.Precision.from_config(c), tiny[0], may_read(c.engine, "vllm_dtype"))

    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: False)  # as on an AVX2-only CPU
    warn(GRPOConfig(vllm_dtype="bfloat16", mixed_precision="no"))
    assert [w for w in recwarn if "vllm_dtype='bfloat16'" in str(w.message)], "the warning itself must still fire"
    recwarn.clear()
    warn(GRPOConfig(engine="hf", vllm_dtype="bfloat16", mixed_precision="no"))
    assert not [w for w in recwarn if "100x slower" in str(w.message)]


def test_vespo_trains_with_the_defaults_and_an_explicit_is_correction_on_hf_warns(tmp_path, tiny):
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    c = config(tmp_path, loss_type="vespo", max_steps=1, save_final=False, eval_before_train=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1])
    assert "IS correction off" in trainer.precision_summary()  # the HF engine: nothing to correct
    trainer.use_is = True  # where it resolves on (a bf16 or stale vLLM engine), the run's first line names the mode
    assert "on (token_mask (vespo's token-level mode)" in trainer.precision_summary()
    trainer.use_is = False
    import math

    last = trainer.train()
    assert trainer.state.step == 1 and math.isfinite(last["loss"]) and last["grad_norm"] > 0, last
    with pytest.warns(UserWarning, match="vllm_importance_sampling_correction=True has no effect with the HF engine"):
        GRPOTrainer(config(tmp_path, output_dir=str(tmp_path / "is"), vllm_importance_sampling_correction=True),
                    [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1])

"""Small shared pieces of the trainer tests: a learnable reward, prompt rows, a fast config."""

from grpo_fast.config import GRPOConfig

# a tiny-model run's stop tokens for partial rollouts: eos and a band of ids the random model samples often, so
# some completions end early and others run to the budget and carry over into the next round
STOP_IDS = [2, *range(259, 279)]


def target_fraction(prompts, completions, completion_ids, **columns):
    """Trivially learnable: the fraction of completion tokens with an even id (about 0.5 at the start)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def rows(n=24):
    return [{"prompt": f"question {i}", "answer": str(i)} for i in range(n)]


def config(tmp_path, **overrides):
    """A tiny, fast run in float32 (the engine too): tests compare numbers, which the bf16 CPU defaults would loosen."""
    fields = dict(
        reward_funcs=["target_fraction"], num_generations=4, per_device_train_batch_size=16,
        max_prompt_length=32, max_completion_length=8, max_tokens_per_microbatch=128, learning_rate=3e-2,
        max_steps=2, engine="hf", output_dir=str(tmp_path / "run"), disable_tqdm=True, eval_max_samples=8,
        mixed_precision="no", vllm_dtype="float32",  # numbers compared in float32, whatever this CPU's bf16 defaults
    )
    fields.update(overrides)
    return GRPOConfig(**fields)

"""Fixtures for the TRL integration tests (the tiny Llama is tests/conftest.py's): a prompt dataset and a
deterministic reward, and builders for a stock trl.GRPOTrainer and a FastGRPOTrainer on them."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")


def length_reward(completions, **kwargs):
    """Deterministic reward: some letters score, length scores a little (groups get distinct rewards)."""
    return [float(sum(c.count(ch) for ch in "aeiou") + 0.05 * len(c)) for c in completions]


@pytest.fixture(scope="session")
def prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["ab", "cde", "fgh i", "jk", "lmno", "p", "qrs", "tu"]})


def grpo_config(tmp_dir, **overrides):
    """A small CPU GRPOConfig: fp32 (no bf16 autocast), no logging services, seeded."""
    from trl import GRPOConfig

    fields = dict(
        output_dir=str(tmp_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, seed=0, save_strategy="no",
        epsilon=0.2, epsilon_high=0.28,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


@pytest.fixture
def build(tiny_path, prompts, tmp_path):
    """build(cls, model=None, **config) -> trainer on the tiny model (a path, so TRL builds the ref model)."""

    def _build(cls, model=None, **config):
        return cls(model=model or tiny_path, reward_funcs=length_reward, args=grpo_config(tmp_path, **config),
                   train_dataset=prompts)

    return _build

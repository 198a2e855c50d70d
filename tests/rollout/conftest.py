"""Fixtures of the rollout tests: one tiny model folder per session (see tests/tiny_model.py)."""

import pytest

from tests.tiny_model import build_tiny_model, load_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Folder with a random tiny Llama (fp32 safetensors) + byte-level tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """(model, tokenizer) loaded from `tiny_model_dir`; tests that modify the model must copy it."""
    return load_tiny_model(tiny_model_dir)

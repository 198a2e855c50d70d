"""Fixtures of the rollout tests (the tiny model folder is tests/conftest.py's `tiny_model_dir`)."""

import pytest

from tests.tiny_model import load_tiny_model


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """(model, tokenizer) loaded from `tiny_model_dir`; tests that modify the model must copy it."""
    return load_tiny_model(tiny_model_dir)

"""Fixtures of the trainer tests: one tiny random Llama folder per session."""

import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_trainer"))

"""Fixtures of the trainer tests: one tiny random Llama folder per session, one thread per test.

One thread: on the shared 2-core CI machine a 2-thread torch step of the tiny model took 20x longer
than a 1-thread one (OpenMP threads spinning against other processes); restored after each test.
"""

import pytest
import torch

from tests.tiny_model import build_tiny_model, load_tiny_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_trainer"))


@pytest.fixture
def tiny(tiny_path):
    """(model, tokenizer): a fresh copy of the tiny Llama for each test."""
    return load_tiny_model(tiny_path)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Fixtures of the trainer tests (the tiny model is tests/conftest.py's): one thread per test.

One thread: on the shared 2-core CI machine a 2-thread torch step of the tiny model took 20x longer
than a 1-thread one (OpenMP threads spinning against other processes); restored after each test.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

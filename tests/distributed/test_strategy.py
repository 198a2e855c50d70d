"""distributed_strategy without launching ranks: what `auto` picks, and one process ignoring it."""

import pytest
import torch

from grpo_fast import distributed
from grpo_fast.config import GRPOConfig


def _host_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_auto_shards_what_would_not_fit_half_a_device(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share this host's memory
    # fp32: weights + grads + AdamW's two moments = 16 bytes a parameter; meta tensors take no memory
    fits = int(0.4 * _host_bytes() / 2 / 16)
    too_big = int(0.6 * _host_bytes() / 2 / 16)
    small, big = (torch.nn.Linear(1, n, bias=False, device="meta") for n in (fits, too_big))
    assert distributed.choose_strategy(small, "auto") == "ddp"
    assert distributed.choose_strategy(big, "auto") == "fsdp2"
    assert distributed.choose_strategy(big, "ddp") == "ddp", "an explicit strategy is kept"


def test_one_process_ignores_the_strategy(monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    world = distributed.join("fsdp2")
    assert world == distributed.ONE_PROCESS and not world.joined
    model = torch.nn.Linear(2, 2)
    parallel = distributed.parallelize(model, world, "fsdp2")
    assert parallel.strategy == "none" and parallel.forward is None and not parallel.sharded


def test_strategy_names_are_checked():
    with pytest.raises(ValueError, match="distributed_strategy='zero3' is invalid: expected one of"):
        GRPOConfig(distributed_strategy="zero3")

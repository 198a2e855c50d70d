"""An engine kind is one registered row (`grpo_fast.generation.engines`). This file adds one in the test alone (a
thin subclass of the HF engine that counts its calls, registered as a row of its own): the config takes it as a
choice, its checks read what it runs, and the trainer trains a step on it."""

from __future__ import annotations

import dataclasses

import pytest

from grpo_fast.generation.engines import ENGINE_KINDS, HFEngine, engine_kind, register, unregister


class CountingEngine(HFEngine):
    """The HF engine, counting its `generate` calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generate_calls = 0

    def generate(self, *args, **kwargs):
        self.generate_calls += 1
        return super().generate(*args, **kwargs)


def _build(model=None, tokenizer=None, model_path=None, max_model_len=None, **options):
    return CountingEngine(model, tokenizer, max_model_len=max_model_len)


@pytest.fixture
def counting():
    kind = register(dataclasses.replace(engine_kind("hf", loadable_from_disk=False), name="counting", build=_build,
                                        summary="the HF engine, counting its generate calls"))
    try:
        yield kind.name
    finally:
        unregister(kind.name)


def test_the_built_in_kinds_are_the_registry():
    assert list(ENGINE_KINDS) == ["vllm", "hf"]
    assert engine_kind("auto", loadable_from_disk=False).name == "hf"  # (vLLM loads from a folder)


def test_a_new_engine_kind_is_a_choice_its_checks_read_and_the_trainer_trains_a_step_on(counting, tmp_path, tiny):
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    with pytest.raises(ValueError, match=r"engine='counting' is invalid: expected 'vllm' or 'auto' with max_staleness=1"):
        config(tmp_path, engine=counting, max_staleness=1)
    c = config(tmp_path, engine=counting, max_steps=1, save_final=False, eval_before_train=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1])
    last = trainer.train()
    assert isinstance(trainer.engine, CountingEngine) and trainer.engine.generate_calls >= 1
    assert last["loss"] == last["loss"], last  # a number: the step trained on the row's samples


def test_asleep_wakes_the_engine_also_when_the_block_raises():
    from grpo_fast.generation.engines.base import asleep

    class Engine:
        def __init__(self):
            self.calls = []

        def sleep(self):
            self.calls.append("sleep")

        def wake(self):
            self.calls.append("wake")

    engine = Engine()
    with pytest.raises(RuntimeError, match="a training pass failed"):
        with asleep(engine, True):
            engine.calls.append("train")
            raise RuntimeError("a training pass failed")
    assert engine.calls == ["sleep", "train", "wake"]
    with asleep(engine, False):  # (not in sleep mode: never put to sleep)
        engine.calls.append("train")
    assert engine.calls == ["sleep", "train", "wake", "train"]

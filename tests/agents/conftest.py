"""Fixtures of the agents' tests: the HF engine on the tiny tool-calling model, built once (no trainer)."""

import pytest


@pytest.fixture(scope="session")
def tool_engine(tool_model_dir):
    """(HFEngine, tokenizer) of the tiny model made to call tools (tool_model.py): real sampling, no trainer."""
    from grpo_fast.generation.engines.hf_engine import HFEngine
    from tests.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(tool_model_dir)
    return HFEngine(model, tokenizer), tokenizer

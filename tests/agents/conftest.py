"""The tiny model made to call tools (tests/agents/tool_model.py), built once per session."""

import pytest


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    from tests.agents.tool_model import build_tool_model

    return build_tool_model(tmp_path_factory.mktemp("tiny_tool_model"))

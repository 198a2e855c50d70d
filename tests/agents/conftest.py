"""The tiny model made to call tools (tests/agents/tool_model.py), built once per test run: under pytest-xdist the
first worker to need it builds it in the run's shared temporary folder while the others wait on a lock (two
builds at once on two cores took ~30 s each instead of ~8 s)."""

import pytest


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory, worker_id) -> str:
    from filelock import FileLock

    from tests.agents.tool_model import build_tool_model

    if worker_id == "master":  # (no xdist: this process is the run)
        return build_tool_model(tmp_path_factory.mktemp("tiny_tool_model"))
    path = tmp_path_factory.getbasetemp().parent / "tiny_tool_model"  # (the run's folder, shared by its workers)
    with FileLock(str(path) + ".lock"):
        if not (path / "tokenizer_config.json").exists():  # (written last: a complete model)
            build_tool_model(path)
    return str(path)

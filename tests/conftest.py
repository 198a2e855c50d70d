"""Test setup shared by the whole suite.

Without a GPU, Triton kernels run through Triton's interpreter: TRITON_INTERPRET must be set
before any kernel is defined, so it is set here, before the tests import grpo_fast.kernels.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at test time
# trackio reads TRACKIO_DIR once, when first imported (TRL and transformers may import it while the tests are
# collected): the suite's trackio runs go to a folder of this process, removed at its exit
if "TRACKIO_DIR" not in os.environ:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="grpo_fast-tests-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The longest test files, longest first (seconds, each file run alone on the shared 2-core machine): `make test`
# hands its 2 workers whole files in collection order (--dist loadfile --no-loadscope-reorder), so these start first
# and the short files fill in behind them, and the workers end together. (xdist's own order, most tests first, left
# these few-test files for last, where one could hold a worker long after the other had run out of files.)
LONGEST_FIRST = (
    "tests/distributed/test_trainer_ranks.py",  # 97 (the tool model's build, 13, with it: its first user)
    "tests/faults/test_kill_resume.py",  # 56 (the uninterrupted reference's run with it: its first user)
    "tests/faults/test_launcher.py",  # 36
    "tests/rollout/test_vllm_lora.py",  # 31
    "tests/golden/test_golden_run.py",  # 27
    "tests/agents/test_multi_turn.py",  # 24
    "tests/sandbox/test_code_tests.py",  # 22
    "tests/trainer/test_partial_rollouts.py",  # 22
    "tests/faults/test_tracker_resume.py",  # 21
    "tests/integrations/test_trl_training.py",  # 19
    "tests/integrations/test_trl_distributed.py",  # 19
    "tests/rollout/test_vllm_engine.py",  # 18
    "tests/rewards/test_judge.py",  # 17
    "tests/sandbox/test_escapes.py",  # 16
    "tests/agents/test_agent_rounds.py",  # 15
    "tests/sandbox/test_reward_hacking.py",  # 15
)


def pytest_collection_modifyitems(config, items):
    first = {path: k for k, path in enumerate(LONGEST_FIRST)}
    # (a stable sort: the other files, and each file's tests, keep their order)
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; its CPU twin runs through the Triton interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def default_threads() -> int:
    """One torch thread in every test process, from its first fixture on (session- and module-scoped engines and
    training runs included); yields the machine's default count, restored at the end. The suite runs 2 workers on 2
    cores: torch's default of a thread per core makes OpenMP threads spin against the other worker (a module of
    vLLM runs: 327 s at the default count, 55 s on one thread, on the shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    """One folder with a random tiny Llama (fp32 safetensors) + byte-level tokenizer (tests/tiny_model.py)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_path) -> str:
    return tiny_path


def built_once(tmp_path_factory, worker_id: str, name: str, build, last_file: str) -> Path:
    """The folder `name` that `build(folder)` fills, built once per test run: under pytest-xdist the first worker to
    need it builds it in the run's shared temporary folder while the others wait on a lock (a session fixture is
    per worker: two builds at once on two cores cost each of them double). `last_file`, relative to the folder, is
    written last by `build`: there, the build is complete."""
    from filelock import FileLock

    if worker_id == "master":  # (no xdist: this process is the run)
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    path = tmp_path_factory.getbasetemp().parent / name  # (the run's folder, shared by its workers)
    with FileLock(str(path) + ".lock"):
        if not (path / last_file).exists():
            shutil.rmtree(path, ignore_errors=True)  # (a build that failed part way)
            path.mkdir()
            build(path)
    return path


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory, worker_id) -> str:
    """The tiny model made to call tools (tests/agents/tool_model.py), built once per test run (two builds at
    once on two cores took ~30 s each instead of ~8 s)."""
    from tests.agents.tool_model import build_tool_model

    return str(built_once(tmp_path_factory, worker_id, "tiny_tool_model", build_tool_model, "tokenizer_config.json"))


@pytest.fixture
def tiny(tiny_path):
    """(model, tokenizer): a fresh copy of the tiny Llama for each test."""
    from tests.tiny_model import load_tiny_model

    return load_tiny_model(tiny_path)

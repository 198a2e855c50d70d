"""Fixtures of the fault tests: a prompt file, `grpo-fast` in a subprocess, one thread per test."""

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.conftest import one_thread  # noqa: F401 - the same autouse fixture here

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "answer": str(i)}) + "\n" for i in range(24)))
    return str(path)


def start(argv, fault=None, **popen):
    """`python -m tests.faults.driver [--fault fault] argv` in the repository, one thread."""
    cmd = [sys.executable, "-m", "tests.faults.driver", *(["--fault", fault] if fault else []), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def run(argv, fault=None, timeout=300):
    """Run to the end: (return code, stdout, stderr)."""
    proc = start(argv, fault)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err

"""Fixtures of the fault tests: a prompt file, `grpo-fast` in a subprocess (or, with no fault to inject, in the
test's own process), one thread per test."""

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

from tests.conftest import built_once
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


def run_here(argv):
    """`run(argv)` without a fault, in this process (one torch thread, as the driver's; a test process is one plain
    process, and starting another costs ~5 s of imports): (return code, stdout, stderr), what it logs and warns
    included."""
    from tests.faults import driver

    out, err = io.StringIO(), io.StringIO()
    handlers = logging.root.handlers[:]
    logging.root.handlers[:] = []  # (so that the command's logging.basicConfig writes to `err`, as in its own process)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            code = driver.main(list(argv))
        finally:  # (this process's logging as it was, for the tests after this one)
            logging.root.handlers[:] = handlers
    return code, out.getvalue(), err.getvalue()


def fault_args(tiny_path, prompts_file, out, *extra):
    """The fault tests' run: 4 steps of the tiny model on the HF engine, a checkpoint every step."""
    return ["train", "--disable_tqdm", "--model", tiny_path, "--engine", "hf", "--dataset", prompts_file,
            "--reward_funcs", "tests.trainer.common:target_fraction", "--num_generations", "4",
            "--per_device_train_batch_size", "8", "--max_prompt_length", "32", "--max_completion_length", "8",
            "--max_tokens_per_microbatch", "128", "--learning_rate", "3e-2", "--max_steps", "4", "--save_steps", "1",
            "--mixed_precision", "no", "--output_dir", str(out), *extra]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id, tiny_path, prompts_file):
    """`fault_args` run uninterrupted, in one process: what every interrupted-then-resumed run must equal. Once per
    test run (the workers' tiny models and prompt files are the same bytes: seeded)."""
    def train(folder):
        code, _, err = run_here(fault_args(tiny_path, prompts_file, folder / "run"))
        assert code == 0, err

    return str(built_once(tmp_path_factory, worker_id, "reference", train, "run/summary.json") / "run")

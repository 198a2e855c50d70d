"""vLLM engines inside a torchrun world (the spike of docs/design.md, "Many processes"): two gloo
ranks, one in-process engine each (vLLM builds its groups on the default one: each rank its own TP=1
engine). Per-prompt seeds make the ranks' split sample what one process samples, and closing an
engine leaves the trainer's process group alive."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_two_engines_in_a_world_of_two(tiny_model_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "distributed" / "engines_in_a_world.py"), tiny_model_dir]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert seen == {"world": 2, "split_equals_whole": True, "all_reduce": 3.0}
    assert "Invalid process group" not in done.stderr, "an engine's teardown destroyed the trainer's group"

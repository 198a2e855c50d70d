"""The fused loss under DDP and FSDP2 (2 gloo ranks; tests/distributed/sharded_head.py): the trainer
hands the lm_head weight to the fused op without the lm_head's forward, so the wrappers' hooks never
see it. DDP still reduces its gradient; FSDP2 with the lm_head in the root unit passes the whole
weight; with the lm_head a unit of its own, `policy_parts` unshards it and FSDP2 reduce-scatters its
gradient; a weight left sharded is an error, never a shard passed off as the whole weight."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_gradients_match_one_process_and_a_shard_is_refused(tiny_model_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "distributed" / "sharded_head.py"), tiny_model_dir]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    refused = seen.pop("fsdp2_resharded_root, tied")
    assert refused == "the lm_head weight is sharded (DTensor of local shape (160, 128)) where the fused loss reads it", refused
    assert all(isinstance(v, float) and v < 1e-5 for v in seen.values()), seen  # float32 reduction order

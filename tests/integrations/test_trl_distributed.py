"""FastGRPOTrainer under DDP (2 gloo CPU processes, torchrun; tests/integrations/trl_ranks.py) makes
stock trl.GRPOTrainer's update: the same sampled completions on each rank, the same logged metrics
and the same final weights, for each config of trl_ranks.CONFIGS.

What DDP changes for the adapter: each rank holds half the batch, DDP averages the ranks' gradients,
TRL's dapo normaliser is all ranks' tokens / world size, and the logged metrics and the adaptive
entropy controller reduce over the ranks. A loss scaled wrong for any of these changes the update by a
fraction of order 1 (trl_ranks.py turns gradient clipping off so that it cannot undo that); checked by
hand: dropping the world size from the dapo normaliser, or multiplying the grpo loss by it, fails both
cases, at the samples of generation 1 (drawn after the first, differing update) with the logged loss
and grad_norm off by ~2x.

Why the two runs sample the same completions: see tests/integrations/test_trl_training.py (the same
seeds, no random numbers drawn by either loss, weights equal to ~1e-7); checked, not assumed. The
weights are compared relative to each tensor's update from the initial weights: SGD makes a weight
difference lr x a gradient difference, so it is a fraction of the update, whatever the weights' size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_close

pytest.importorskip("trl")
from safetensors.torch import load_file  # noqa: E402

from .trl_ranks import CONFIGS, PER_RANK_GENERATION  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integrations" / "trl_ranks.py")
# fp32 summation order (DDP's bucketed all-reduce, the fused kernels' chunking) leaves ~1 ulp of the weights
# (measured: at most 1.2e-7, 3.9e-5 of a tensor's update); a wrong loss scale moves them by a fraction of order 1
UPDATE_FRACTION = 1e-3
LOGGED = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_max", "reward",
          "entropy_coef", "policy_loss")


def _launch(which: str, model_dir: str, out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, which,
           model_dir, str(out), *CONFIGS]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{which} on 2 ranks failed:\n{done.stderr[-4000:]}"


def _first_difference(a: list, b: list) -> int | None:
    """Index of the first sample where a and b differ (or the shorter one ends); None when equal."""
    return next((i for i in range(max(len(a), len(b))) if i >= min(len(a), len(b)) or a[i] != b[i]), None)


def _logged(run: dict, key: str) -> str:
    return f"{run['trainer']} {key} " + str([f"{h[key]:.4g}" for h in run["logs"]])


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """{trainer: out folder} after one 2-rank launch training both trainers on every config."""
    out = tmp_path_factory.mktemp("trl_ddp")
    _launch("stock,fast", tiny_model_dir, out)
    return {which: out / which for which in ("stock", "fast")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_trainer_on_two_ranks_matches_stock_trl(runs, tiny_model_dir, name):
    stock = json.loads((runs["stock"] / name / "run.json").read_text())
    fast = json.loads((runs["fast"] / name / "run.json").read_text())

    # first: the comparison below is only meaningful when both trainers trained on the same samples
    for rank, (s, f) in enumerate(zip(stock["samples"], fast["samples"], strict=True)):
        first = _first_difference(s, f)
        assert first is None, (
            f"{name}: rank {rank} sampled differently in the two runs from sample {first} of {len(s)} on (generation "
            f"{first // PER_RANK_GENERATION}); after generation 0 an earlier update already differed: "
            f"{_logged(fast, 'loss')} vs stock {_logged(stock, 'loss')}, {_logged(fast, 'grad_norm')} vs stock "
            f"{_logged(stock, 'grad_norm')}")
    for run in (stock, fast):  # really distributed: 2 processes, DDP, each rank its own share of the batch
        assert (run["num_processes"], run["distributed_type"], run["wrapper"]) == (
            2, "DistributedType.MULTI_CPU", "DistributedDataParallel"), run
        assert run["global_step"] == 3 and len(run["logs"]) == 3
    assert stock["samples"][0] != stock["samples"][1], "both ranks sampled the same batch: no data parallelism"

    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    w_stock = load_file(runs["stock"] / name / "weights.safetensors")
    w_fast = load_file(runs["fast"] / name / "weights.safetensors")
    assert w_fast.keys() == w_stock.keys()
    moved = max((w - initial[n]).abs().max().item() for n, w in w_stock.items())
    assert moved > 1e-3, f"training barely moved the weights ({moved:.2g}): the comparison would prove nothing"
    for n, w in w_stock.items():
        update = (w - initial[n]).abs().max().item()
        assert update > 0, f"{n} did not move in stock TRL's run: no update to compare against"
        gap = (w_fast[n] - w).abs()
        worst = int(gap.argmax())
        assert gap.max().item() <= UPDATE_FRACTION * update, (
            f"{name}: weight {n} differs by {gap.max().item():.3g} at flat index {worst} (fast "
            f"{w_fast[n].reshape(-1)[worst].item():.6g}, stock {w.reshape(-1)[worst].item():.6g}), "
            f"{gap.max().item() / update:.3g} of its update {update:.3g}; allowed {UPDATE_FRACTION}")

    for step, (h_fast, h_stock) in enumerate(zip(fast["logs"], stock["logs"], strict=True)):
        for key in LOGGED:
            assert (key in h_fast) == (key in h_stock), f"{name} step {step}: {key} logged by one trainer only"
            if key in h_stock:
                assert_close(h_fast[key], h_stock[key], atol=1e-5, rtol=1e-4, name=f"{name} step {step} {key}")
    if CONFIGS[name].get("use_adaptive_entropy"):  # the controller saw all ranks' entropy alike, and its gate opened
        assert fast["entropy_coef"] == pytest.approx(stock["entropy_coef"], rel=1e-6)
        assert fast["entropy_coef"] > CONFIGS[name]["entropy_coef"]

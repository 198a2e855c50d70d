"""The eager path of the fused ops loads no compiler: a fresh process that computes one CPU loss
imports neither torch._dynamo nor sympy nor triton (issue 27 item 8: they cost ~900 modules and
~180 MB RSS). Once torch._dynamo is loaded, torch.compile still traces the same ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close, scaled
from tests.ops.cases import backend_params

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "sympy", "triton", "torch._inductor")

# Every eager route of the public ops: the one-pass loss op, the sequence-level route (log-probs op
# + its backward op), the log-prob op alone, each with backward.
_EAGER = """
import sys, torch
from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs

def leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, 16, generator=g).requires_grad_(True)
    weight = (torch.randn(40, 16, generator=g) * 0.25).requires_grad_(True)
    target = torch.randint(0, 40, (2, 6), generator=g)
    advantages, mask, old = torch.randn(2, generator=g), torch.ones(2, 6), -torch.rand(2, 6, generator=g)
    return hidden, weight, target, advantages, mask, old

def step(hidden, weight, target, advantages, mask, old):
    loss, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, old_logp=old, backend=BACKEND)
    seq, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, old_logp=old, backend=BACKEND,
                                    importance_sampling_level="sequence")
    logp = fused_linear_logprobs(hidden, weight, target, backend=BACKEND)
    return loss + seq + 0.1 * logp.sum()

x = leaves()
eager = step(*x)
eager.backward()
heavy = [m for m in HEAVY if m in sys.modules]
assert not heavy, f"the eager CPU ops imported {heavy}"
"""

# Then the same process compiles the same step: the kernels now run with dynamo disabled.
_COMPILED = """
y = leaves()
compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*y)
compiled.backward()
torch.save(dict(eager=(eager.detach(), x[0].grad, x[1].grad), compiled=(compiled.detach(), y[0].grad, y[1].grad)), OUT)
"""


def _run(code: str, backend: str, out: Path | None = None) -> None:
    preamble = f"BACKEND = {backend!r}\nHEAVY = {HEAVY!r}\nOUT = {str(out)!r}\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # what a user's CPU process has (conftest sets it for the kernel tests)
    done = subprocess.run([sys.executable, "-c", preamble + code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# (the cpu backend's eager check runs first in test_compile_after_eager_calls_matches_eager: the same script, then
# compiled; one process less for the suite)
@pytest.mark.parametrize("backend", [p for p in backend_params(triton=False) if p.id != "cpu"])
def test_eager_cpu_ops_import_no_compiler(backend):
    _run(_EAGER, backend)


@pytest.mark.parametrize("backend", ["cpu"])  # one registration serves every backend: the CPU default suffices
def test_compile_after_eager_calls_matches_eager(backend, tmp_path):
    out = tmp_path / "results.pt"
    _run(_EAGER + _COMPILED, backend, out)
    results = torch.load(out)
    for name, got, expected in zip(("loss", "grad hidden", "grad weight"), results["compiled"], results["eager"],
                                   strict=True):
        assert_close(got, expected, atol=scaled(1e-6, expected), name=f"{backend} compiled {name}")

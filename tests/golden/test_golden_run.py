"""The golden runs: fixed-seed 3-step runs of the tiny model (scripts/golden_run.py) against the committed
summaries in tests/golden/goldens/. Refactors keep behaviour: a change here means the training changed.

The goldens are written by hand (`python scripts/golden_run.py CASE OUT`, then copy OUT/summary.json to
tests/golden/goldens/CASE.json), never by this test, one set per kind of CPU (`GOLDEN_SETS`): the float
results of 3 steps at a large learning rate differ between CPU kinds (AVX-512 and AMX GEMMs sum in another
order, and the steps amplify it: an AMD EPYC with avx512_bf16 ended 2e-3 off the Intel AMX golden's grad_norm,
3.5e-2 off its near-zero loss with partial rollouts). A CPU kind with its own set is compared as below; one
without (AVX2-only) is compared with the AMX set within `CROSS_KIND` (every float 5e-2 relative, the weights
1e-3). What is compared:
- counts (integers) exactly; rewards and lengths to 1e-9 relative: they come from the sampled tokens, so
  one token sampled differently moves them by far more, while float64 sums of the same values may differ
  in the last bit between CPU kinds (AVX2 and AVX-512 reduce in another order);
- every other value within 1e-4 relative (the loss relative to the advantages' magnitude, the terms it
  sums: it is a near-zero difference by construction);
- the engine/trainer gaps where the tokens are fresh (float rounding of the same numbers on two paths)
  against their float32 bound, 1e-3, not against a golden: they measure the machine's rounding, not the
  run (stale tokens' gaps, with partial rollouts, are real and compared as the rest);
- the final weights per tensor: the norm within 1e-5 relative, the sum within 1e-5 of the sum of magnitudes.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fast.generation.engines import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = Path(__file__).parent / "goldens"
# the goldens of each CPU kind, written on such a CPU (the AMX set on a Sapphire Rapids Xeon at eccc1d1, the
# avx512_bf16 set on an AMD EPYC at 6f292c2: the same code, bitwise the same runs on each machine)
GOLDEN_SETS = {"amx": GOLDENS, "avx512_bf16": GOLDENS / "avx512_bf16"}
CROSS_KIND = 5e-2  # relative bound of every float compared with another kind's golden (weights: 1e-3)
CASES = ("hf_beta_mu2", "vllm", "vllm_partial", "early_exit")
SAMPLED = ("reward", "length")  # keys that come straight from the sampled tokens
GAPS = ("sampling/logp_diff", "sampling/sync_check_diff")
RATIOS = ("sampling/importance_sampling_ratio",)
# metrics logged since the goldens were written, not in them (as scripts/golden_compare.sh lists an added metric)
ADDED = frozenset({"sampling/engine_ratio_mean", "sampling/engine_ratio_outside"})


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """Every case run once, one after the other in one process (one thread; each case seeds itself, so its
    summary is the one a process of its own writes, and the process start and vLLM's imports are paid once)."""
    out = tmp_path_factory.mktemp("golden")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    pairs = [arg for case in CASES for arg in (case, str(out / case))]
    done = subprocess.run([sys.executable, "scripts/golden_run.py", *pairs], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [line for line in done.stdout.splitlines() if line.endswith("summary.json")]
    assert len(paths) == len(CASES), done.stdout[-2000:]
    return {case: json.loads(Path(path).read_text()) for case, path in zip(CASES, paths, strict=True)}


def cpu_kind() -> str:
    """amx, avx512_bf16 or avx2: the CPU features the float results of a run depend on."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "avx2"


def _mismatches(got: dict, want: dict, cross_kind: bool = False) -> list[str]:
    rel, weights_rel = (CROSS_KIND, 1e-3) if cross_kind else (1e-4, 1e-5)
    bad = []
    if len(got["rows"]) != len(want["rows"]):
        return [f"{len(got['rows'])} metrics rows, the golden has {len(want['rows'])}"]
    for i, (g, w) in enumerate(zip(got["rows"], want["rows"], strict=True)):
        if g.keys() - (ADDED - w.keys()) != w.keys():
            bad.append(f"row {i}: keys differ: {sorted((g.keys() - (ADDED - w.keys())) ^ w.keys())}")
            continue
        for key, expected in w.items():
            value = g[key]
            if key.startswith(GAPS) and expected < 1e-3:  # fresh tokens: rounding of the same numbers
                ok = value < 1e-3
            elif key.startswith(RATIOS) and abs(expected - 1) < 1e-3:
                ok = abs(value - 1) < 1e-3
            elif isinstance(expected, int) and not isinstance(expected, bool):
                ok = value == expected
            elif key.startswith(SAMPLED) or "length" in key:
                ok = math.isclose(value, expected, rel_tol=1e-9)
            elif key == "loss":
                ok = abs(value - expected) <= rel * max(abs(expected), w.get("advantages/abs_mean", 0.0))
            else:
                ok = math.isclose(value, expected, rel_tol=rel, abs_tol=0.0) or value == expected
            if not ok:
                bad.append(f"row {i} (step {w.get('step')}): {key} = {value!r}, golden {expected!r}")
    for name, (s, l1, norm) in want["weights"].items():
        gs, _, gnorm = got["weights"][name]
        if not (abs(gs - s) <= weights_rel * l1 and math.isclose(gnorm, norm, rel_tol=weights_rel)):
            bad.append(f"weight {name}: sum {gs!r} norm {gnorm!r}, golden sum {s!r} norm {norm!r}")
    return bad


@pytest.mark.parametrize("case", CASES)
def test_golden_run(case, summaries):
    kind = cpu_kind()
    folder = GOLDEN_SETS.get(kind, GOLDEN_SETS["amx"])
    want = json.loads((folder / f"{case}.json").read_text())
    bad = _mismatches(summaries[case], want, cross_kind=kind not in GOLDEN_SETS)
    assert not bad, (f"{case}: {len(bad)} mismatches with {folder.relative_to(ROOT)}/{case}.json (this CPU: {kind}); "
                     f"first: " + "; ".join(bad[:8]))

#!/usr/bin/env bash
# Everything grpo_fast checks and measures on a GPU, in one command, under 5 minutes on one H200:
#
#   bash benchmarks/gpu_suite.sh OUTDIR
#
# Runs from a plain checkout with the machine's own python (torch, triton, pytest; no install, no
# C++ extension, no network). Stages, each under `timeout`, each writing into OUTDIR (<= 8 files):
#   1. pytest -m gpu tests/kernels, tests/ops      -> pytest.log   (compiled kernels vs the reference)
#   2. benchmarks/check_gpu.py --sweep              -> check_gpu.{json,md}  (matmul peak, fused vs floor)
#   3. benchmarks/check_trainer_gpu.py              -> check_trainer.json (GRPOTrainer on CUDA: LoRA and
#      QLoRA (bitsandbytes, when carried: only the adapter changes), bf16
#      weights, bf16 autocast, FSDP2 on one rank over NCCL, multi-turn tool rollouts with the HF engine,
#      a reward model on the device; packed = padded log-probs; peak memory)
#   4. this wave's features (issue 52), 40 s together, before the loss benchmark so a budget cut falls on it;
#      in order of value (their .md in summary.md, their .json merged into wave.json):
#      kept-spec  the logit maps (soft-cap, scale) and the kept-set fused op (Triton) against objective.py's
#                 spec (float64 logits) at V = 151936, k = 20 and 512, bf16 (the inline KEPT_SPEC below)
#      moe-step   benchmarks/check_moe_step.py: a tiny Qwen3-MoE's fused step + router loss = the model's own
#      vlm-step   benchmarks/check_vlm_step.py --preset check: a tiny Qwen2-VL's fused step = the model's own
#      kept-cost  benchmarks/bench_kept.py: kept-set loss / logp against the full fused op (N=2048, H=896)
#      logit-maps-cost (only when named in GPU_SUITE_STAGES: bench_loss.py --preset cuda-logit-maps, ~40 s)
#      Skipped: sequence parallelism (needs >= 2 GPUs; this machine has one) and the sandbox (CPU-only).
#      vLLM is not tested: the GPU image has none and its wheel is larger than a run can carry.
#   5. benchmarks/bench_loss.py --device cuda       -> bench_loss.*  (plain PyTorch / Liger / grpo_fast),
#      its --budget the suite's time left (partial figures rather than a kill)
# plus suite.log (all output, the pytest logs included) and summary.md (with check_trainer's table).
# Dry run on a CPU: GPU_SUITE_DRY_RUN=1 bash benchmarks/gpu_suite.sh OUTDIR (or --dry-run OUTDIR): the new
# stages' scripts with --device cpu / --dry_run at small shapes (Triton's interpreter), the GPU-only stages
# skipped with a line saying so; checks that the stages run, measures nothing.
# Each stage runs alone too: GPU_SUITE_STAGES="trainer check-gpu" bash benchmarks/gpu_suite.sh OUTDIR
# (names: pytest-kernels pytest-ops check-gpu trainer kept-spec moe-step vlm-step kept-cost logit-maps-cost
# bench-loss). A failing stage is reported and
# the next one still runs; the exit status is the number of failed stages.
set -u -o pipefail

DRY_RUN=${GPU_SUITE_DRY_RUN:-0}
if [ "${1:-}" = --dry-run ]; then
    DRY_RUN=1
    shift
fi
OUT=${1:?usage: gpu_suite.sh [--dry-run] OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
SCRATCH=$(mktemp -d)  # the new stages' own files: at most 8 files come back from the device, so they are merged
# QLoRA needs bitsandbytes, which the GPU image lacks: `make gpu-wheels` downloads its wheel (43 MB) into
# gpu_wheels/ (git-ignored); carry that folder with the device call (`carry: ["gpu_wheels"]`) and it is
# installed here into a scratch folder put on PYTHONPATH (no network needed on the GPU machine).
for wheel in "$ROOT"/gpu_wheels/bitsandbytes-*.whl; do
    [ -f "$wheel" ] || continue
    "$PY" -m pip install -q --no-deps --target /tmp/gpu_suite_site "$wheel" \
        && export PYTHONPATH="/tmp/gpu_suite_site:$PYTHONPATH"
done
[ "$DRY_RUN" = 1 ] && GPU_SUITE_BUDGET_S=${GPU_SUITE_BUDGET_S:-900}  # (a loaded 2-core CPU)
BUDGET_S=${GPU_SUITE_BUDGET_S:-290}  # whole suite (the last run took 205 s before the trainer stage); each stage has its own cap
START=$(date +%s)
FAILED=0
exec > >(tee -a "$OUT/suite.log") 2>&1

# `grpo_fast.kernels` is the kernels/ folder, mapped by setup.py at install time. In a plain checkout
# link it into the package for this run (and remove the link afterwards).
LINK=""
if ! "$PY" -c "import grpo_fast.kernels" 2>/dev/null; then
    if [ ! -e grpo_fast/kernels ]; then
        ln -s ../kernels grpo_fast/kernels && LINK=grpo_fast/kernels
    fi
fi
trap '[ -n "$LINK" ] && rm -f "$LINK"; rm -rf "$SCRATCH"' EXIT

echo "== gpu_suite $(date -u +%FT%TZ) in $ROOT, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
# a copied tree's .git can be stale: this hash names the code that runs (same command on a checkout)
SOURCES=$(find grpo_fast kernels csrc benchmarks -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.sh' \) \
    -not -path '*/__pycache__/*' | LC_ALL=C sort)
echo "sources sha1 $(cat $SOURCES | sha1sum | cut -c1-12) (grpo_fast/**, kernels/**, csrc/**, benchmarks/**)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
"$PY" -c "import grpo_fast.kernels.linear_logprobs as k; print('grpo_fast.kernels from', k.__file__)" || FAILED=$((FAILED + 1))

stage() {  # stage NAME CAP_SECONDS LOGFILE command...   (LOGFILE: also tee the output there; - for none)
    local name=$1 cap=$2 log=$3
    shift 3
    if [ -n "${GPU_SUITE_STAGES:-}" ] && [[ " $GPU_SUITE_STAGES " != *" $name "* ]]; then
        return  # not asked for this run
    fi
    if [ "$DRY_RUN" = 1 ] && [ "$cap" != dry ]; then
        echo "== $name: SKIPPED (dry run: GPU only)"
        echo "| $name | skipped (dry run: GPU only) | 0 |" >>"$OUT/.stages"
        return
    fi
    [ "$cap" = dry ] && cap=${DRY_CAP:-600}
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "== $name: SKIPPED, suite budget spent"
        echo "| $name | skipped (budget) | 0 |" >>"$OUT/.stages"
        FAILED=$((FAILED + 1))
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    local what="$*"
    echo "== $name (cap ${cap}s): ${what:0:200}"
    local t0 rc status
    t0=$(date +%s)
    if [ "$log" = - ]; then
        timeout --kill-after=10 "$cap" "$@"
        rc=$?
    else
        timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
    fi
    status=ok
    if [ "$rc" -eq 5 ] && [ "${name#pytest}" != "$name" ]; then
        status="no gpu tests collected"
        rc=0
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMED OUT after ${cap}s"
    elif [ "$rc" -ne 0 ]; then
        status="FAILED rc=$rc"
    fi
    [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
    echo "== $name: $status in $(($(date +%s) - t0))s"
    echo "| $name | $status | $(($(date +%s) - t0)) |" >>"$OUT/.stages"
}

: >"$OUT/.stages"
# 1. correctness of the compiled kernels (one pytest per folder: a collection error in one must not hide the other)
stage pytest-kernels 90 - "$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider --durations=10
if [ -d tests/ops ]; then
    stage pytest-ops 45 - "$PY" -m pytest -q -m gpu tests/ops -p no:cacheprovider --durations=10
fi
# 2. kernel speed against the matmul floor, and launch configurations
stage check-gpu 90 - "$PY" benchmarks/check_gpu.py --out "$OUT" --sweep
# 3. the trainer on CUDA: a few GRPO steps (bf16, autocast, FSDP2 on one rank), packed = padded
#    (before the loss benchmark, whose figures exist already: a cut by the budget falls on those)
stage trainer 90 - "$PY" benchmarks/check_trainer_gpu.py --out "$OUT"
# 4. this wave's features, 40 s of caps together (kept-spec 8 + moe-step 9 + vlm-step 9 + kept-cost 14)
# The logit maps and the kept-set op (Triton) against the spec: float64 logits, bf16 inputs; tolerance 2 x plain
# PyTorch's bf16 error + 2e-3 x the magnitude (tests/ops/test_kept.py's rule). argv: device NxHxV ks backend.
KEPT_SPEC='
import sys, torch
from grpo_fast import objective
from grpo_fast.objective import KeptSets
from grpo_fast.ops import masked_linear_logprobs
from tests.helpers import assert_close, scaled
dev, backend = sys.argv[1], sys.argv[4]
n, h, v = (int(x) for x in sys.argv[2].split("x"))
g = torch.Generator(device=dev).manual_seed(0)
H = torch.randn(n, h, device=dev, generator=g).bfloat16()
W = (torch.randn(v, h, device=dev, generator=g) * h**-0.5 * 2).bfloat16()
T = torch.randint(0, v, (n,), device=dev, generator=g)
gl, ge = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g) * 0.5
cases = [("full softcap 30 scale 1.5", 0, 1.5, 30.0), ("full scale 0.25", 0, 0.25, None)]
cases += [(f"kept k={k} softcap 30", int(k), 1.0, 30.0) for k in sys.argv[3].split(",")]
for name, k, scale, cap in cases:
    kept = None
    if k:
        ids = torch.rand(n, v, device=dev, generator=g).topk(k, -1).indices
        has = (ids == T[:, None]).any(-1)
        ids[~has, 0] = T[~has]
        kept = KeptSets(ids.reshape(-1).contiguous(), torch.arange(n + 1, device=dev) * k)
    def run(dt, op):
        x, w = (t.detach().to(dt).requires_grad_(True) for t in (H, W))
        if op:
            lp, ent = masked_linear_logprobs(x, w, T, None, temperature=0.7, logit_scale=scale, logit_softcap=cap,
                                             backend=backend, return_entropy=True, differentiable_entropy=True, kept=kept)
        else:
            lp, ent = objective.token_logprobs(x @ w.t(), T, 0.7, logit_scale=scale, logit_softcap=cap, kept=kept)
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        return [lp.detach(), ent.detach(), x.grad, w.grad]
    ref, plain, got = run(torch.float64, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for what, a, e, p in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, plain, strict=True):
        tol = 2 * float((p.double() - e).abs().max()) + scaled(2e-3, e)
        assert_close(a.double(), e, atol=tol, name=f"{name} {what}")
    print(f"{name}: logp, entropy, grads = spec (bf16, {backend}, N={n} H={h} V={v})", flush=True)
'
if [ "$DRY_RUN" = 1 ]; then  # small shapes on the CPU, Triton through its interpreter: each stage runs, no figures
    stage kept-spec dry - env TRITON_INTERPRET=1 "$PY" -c "$KEPT_SPEC" cpu 24x32x300 3,17 triton
    stage moe-step dry - "$PY" benchmarks/check_moe_step.py --out "$SCRATCH" --device cpu --dtype float32 --preset check --repeats 1
    stage vlm-step dry - "$PY" benchmarks/check_vlm_step.py --out "$SCRATCH" --device cpu --dtype float32 --preset check --repeats 1
    stage kept-cost dry - "$PY" benchmarks/bench_kept.py --device cuda --dry_run --out "$SCRATCH"
else
    stage kept-spec 8 - "$PY" -c "$KEPT_SPEC" cuda 256x896x151936 20,512 auto
    stage moe-step 9 - "$PY" benchmarks/check_moe_step.py --out "$SCRATCH" --repeats 2
    stage vlm-step 9 - "$PY" benchmarks/check_vlm_step.py --out "$SCRATCH" --preset check --repeats 2
    # N=2048: bench_kept draws each position's set with a randperm of V on the CPU (~1-6 ms each)
    stage kept-cost 14 - "$PY" benchmarks/bench_kept.py --device cuda --sizes 2048x896x151936 --ks 20 512 --repeats 3 --out "$SCRATCH"
    if [[ " ${GPU_SUITE_STAGES:-} " == *" logit-maps-cost "* ]]; then  # the soft-cap's cost: only when named
        stage logit-maps-cost 60 - "$PY" benchmarks/bench_loss.py --preset cuda-logit-maps --out "$SCRATCH"
    fi
fi
# 5. the loss benchmark against plain PyTorch and Liger (its figures exist: its own budget is the suite's time left,
#    so a cut gives fewer sizes rather than a kill)
if [ -f benchmarks/bench_loss.py ]; then
    LOSS_BUDGET=$((BUDGET_S - ($(date +%s) - START) - 10))
    [ "$LOSS_BUDGET" -gt 140 ] && LOSS_BUDGET=140
    [ "$LOSS_BUDGET" -lt 1 ] && LOSS_BUDGET=1
    stage bench-loss 150 - "$PY" benchmarks/bench_loss.py --device cuda --out "$OUT" --budget "$LOSS_BUDGET"
else
    echo "== bench-loss: benchmarks/bench_loss.py not in this checkout"
    echo "| bench-loss | missing | 0 |" >>"$OUT/.stages"
fi

{
    echo "# gpu_suite $(date -u +%FT%TZ)"
    echo
    echo "| stage | status | seconds |"
    echo "| --- | --- | --- |"
    cat "$OUT/.stages"
    echo
    echo "total $(($(date +%s) - START)) s, failed stages: $FAILED"
    [ -f "$OUT/check_gpu.md" ] && { echo; cat "$OUT/check_gpu.md"; }
    [ -f "$OUT/check_trainer.md" ] && { echo; cat "$OUT/check_trainer.md"; }
    for md in "$SCRATCH"/*.md; do
        [ -f "$md" ] && { echo; cat "$md"; }
    done
} >"$OUT/summary.md"
# the new stages' .json in one wave.json ({file stem: its contents})
if ls "$SCRATCH"/*.json >/dev/null 2>&1; then
    "$PY" -c 'import json, pathlib, sys
print(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}, indent=1))' \
        "$SCRATCH" >"$OUT/wave.json"
fi
rm -f "$OUT/check_trainer.md" "$OUT/check_gpu.md"  # in summary.md: at most 8 files come back from the device
rm -f "$OUT/.stages"
cat "$OUT/summary.md"
sleep 1  # let tee flush suite.log before the folder is collected
exit "$FAILED"

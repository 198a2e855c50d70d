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
#   4. benchmarks/bench_loss.py --device cuda       -> bench_loss.*  (plain PyTorch / Liger / grpo_fast)
# plus suite.log (all output, the pytest logs included) and summary.md (with check_trainer's table).
# Each stage runs alone too: GPU_SUITE_STAGES="trainer check-gpu" bash benchmarks/gpu_suite.sh OUTDIR
# (names: pytest-kernels pytest-ops check-gpu bench-loss trainer). A failing stage is reported and
# the next one still runs; the exit status is the number of failed stages.
set -u -o pipefail

OUT=${1:?usage: gpu_suite.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
# QLoRA needs bitsandbytes, which the GPU image lacks: `make gpu-wheels` downloads its wheel (43 MB) into
# gpu_wheels/ (git-ignored); carry that folder with the device call (`carry: ["gpu_wheels"]`) and it is
# installed here into a scratch folder put on PYTHONPATH (no network needed on the GPU machine).
for wheel in "$ROOT"/gpu_wheels/bitsandbytes-*.whl; do
    [ -f "$wheel" ] || continue
    "$PY" -m pip install -q --no-deps --target /tmp/gpu_suite_site "$wheel" \
        && export PYTHONPATH="/tmp/gpu_suite_site:$PYTHONPATH"
done
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
        trap '[ -n "$LINK" ] && rm -f "$LINK"' EXIT
    fi
fi

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
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "== $name: SKIPPED, suite budget spent"
        echo "| $name | skipped (budget) | 0 |" >>"$OUT/.stages"
        FAILED=$((FAILED + 1))
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "== $name (cap ${cap}s): $*"
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
# 4. the loss benchmark against plain PyTorch and Liger
if [ -f benchmarks/bench_loss.py ]; then
    stage bench-loss 150 - "$PY" benchmarks/bench_loss.py --device cuda --out "$OUT"
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
} >"$OUT/summary.md"
rm -f "$OUT/check_trainer.md"  # in summary.md: at most 8 files come back from the device
rm -f "$OUT/.stages"
cat "$OUT/summary.md"
sleep 1  # let tee flush suite.log before the folder is collected
exit "$FAILED"

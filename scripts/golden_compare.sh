#!/usr/bin/env bash
# Bitwise behaviour check of a refactor: the golden cases (scripts/golden_run.py) at commit BASE and in
# this checkout, on this machine, one thread each, compared byte for byte (metrics rows without times,
# the final weights' sha256, sums and norms; a metric only this checkout logs, added since BASE, is listed, not compared).
#
#   scripts/golden_compare.sh BASE [CASE ...]      e.g. scripts/golden_compare.sh 5ec2320
#
# BASE is checked out into a temporary git worktree, its C++ extension built there, and driven by this
# checkout's golden_run.py (it only types the CLI, so it drives an older grpo_fast as well).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: $0 BASE [CASE ...]" >&2; exit 2; }
base=$1; shift
cases=("$@"); [[ ${#cases[@]} -gt 0 ]] || cases=(hf_beta_mu2 vllm vllm_partial early_exit multi_answer lora multi_turn agents_partial)
py=${PYTHON:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/base" "$base"
cp scripts/golden_run.py "$tmp/base/scripts/golden_run.py"
(cd "$tmp/base" && "$py" setup.py -q build_ext --inplace >/dev/null 2>&1)
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
status=0
for case in "${cases[@]}"; do
    (cd "$tmp/base" && "$py" scripts/golden_run.py "$case" "$tmp/out-base/$case" >"$tmp/$case-base.log" 2>&1) &
    "$py" scripts/golden_run.py "$case" "$tmp/out-head/$case" >"$tmp/$case-head.log" 2>&1 || { tail -5 "$tmp/$case-head.log"; exit 1; }
    wait $! || { tail -5 "$tmp/$case-base.log"; exit 1; }
    verdict=$(python3 - "$tmp/out-base/$case/summary.json" "$tmp/out-head/$case/summary.json" <<'PY'
import json, sys
base, head = (json.load(open(p)) for p in sys.argv[1:3])
# a metric the base did not log yet (a later commit added it) is listed, not a difference; every value the
# base logged must be the same, bitwise, and so must the weights
added = sorted({k for row in head["rows"] for k in row} - {k for row in base["rows"] for k in row})
same = (len(base["rows"]) == len(head["rows"]) and base["weights"] == head["weights"]
        and base["weights_sha256"] == head["weights_sha256"]
        and all(b == {k: v for k, v in h.items() if k not in added} for b, h in zip(base["rows"], head["rows"])))
print(("identical" if same else "DIFFERS") + f" ({len(head['rows'])} metrics rows, weights sha256 "
      f"{head['weights_sha256'][:16]}" + (f"; metrics the base did not log: {', '.join(added)}" if added else "") + ")")
PY
)
    echo "$case: $verdict"
    if [[ $verdict == DIFFERS* ]]; then
        diff <(python3 -m json.tool "$tmp/out-base/$case/summary.json") \
             <(python3 -m json.tool "$tmp/out-head/$case/summary.json") | head -20
        status=1
    fi
done
exit $status

"""The default run in float32 against the bf16 CPU defaults, side by side: wall time, its parts, held-out accuracy.

    python benchmarks/bench_precision.py                      # 2 seeds x 2 precisions, ~1 h on 2 AMX cores
    python benchmarks/bench_precision.py --only bf16:1        # one run again; the report covers every run kept
    python benchmarks/bench_precision.py --report_only

Each run is `grpo-fast train` (what `make train` runs) in a subprocess, timed from its start to its
exit, with `--seed S` (which also draws the 200 held-out questions) and:

    float32   --mixed_precision no --vllm_dtype float32     (the defaults before the bf16 CPU defaults)
    bf16      the defaults: on a CPU with AMX or avx512_bf16, a bf16 vLLM engine and the decoder under
              bf16 autocast (on other CPUs the defaults are float32, and so is this run)

Both the wall time ratio (target <= 0.6) and the accuracy (bf16 no worse than float32 beyond the
seed-to-seed spread) are read off the same machine in one report: benchmarks/results/precision_cpu.{md,json,png}.
Runs are kept in --workdir, each as soon as it ends, so a stopped benchmark loses only the run in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

OUT = ROOT / "benchmarks" / "results" / "precision_cpu"
PRECISIONS = {"float32": ["--mixed_precision", "no", "--vllm_dtype", "float32"], "bf16": []}
COMPLETIONS = 64  # completions per step of the default run (8 prompts x 8)
PARTS = ("time/generate", "time/logprob", "time/train", "time/weight_sync", "time/sync_check")


def run_one(name: str, workdir: Path, timeout_min: float) -> dict:
    precision, seed = name.split(":")
    out = workdir / name.replace(":", "_seed")
    cmd = [sys.executable, "-m", "grpo_fast.cli", "train", "--overwrite_output_dir", "--disable_tqdm", "true",
           "--output_dir", str(out), "--seed", seed, *PRECISIONS[precision]]
    print(f"[bench_precision] {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60 * timeout_min)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": done.stderr[-2000:], "wall_s": wall}
    (out / "run.log").write_text(done.stdout + done.stderr)
    (out / "wall_s").write_text(f"{wall:.1f}\n")
    return collect(out)


def collect(out: Path) -> dict:
    """The figures of a finished run folder (metrics.jsonl, run.log, and its wall time in wall_s)."""
    log = (out / "run.log").read_text().splitlines() if (out / "run.log").exists() else []
    resolved = [line for line in log if line.startswith("precision:")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/train" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"wall_s": float((out / "wall_s").read_text()), "precision_line": resolved[-1] if resolved else None,
            "steps": len(steps), "mean_step_s": sum(r["step_time"] for r in steps) / len(steps),
            "parts_s": {p: sum(r.get(p, 0.0) for r in steps) / len(steps) for p in PARTS},
            "eval_s": sum(r["time/eval"] for r in rows if "time/eval" in r),
            # per token, since the two precisions' runs learn different answer lengths
            "generated_tokens_per_s": sum(r["completions/mean_length"] * COMPLETIONS for r in steps)
            / sum(r["time/generate"] for r in steps),
            "train_ms_per_token": 1000 * sum(r["time/train"] for r in steps) / sum(r["num_tokens"] for r in steps),
            "mean_completion_length": sum(r["completions/mean_length"] for r in steps) / len(steps),
            "eval_history": evals, "reward_history": [(r["step"], r["reward"]) for r in steps],
            "note": (out / "note").read_text().strip() if (out / "note").exists() else None,
            "sync_check_diff_max": max((r.get("sampling/sync_check_diff", 0.0) for r in steps), default=0.0)}


def markdown(runs: dict, command: str, env: dict) -> str:
    ok = {n: r for n, r in runs.items() if "error" not in r}
    seeds = sorted({n.split(":")[1] for n in ok}, key=int)
    lines = ["# The default run: float32 against the bf16 CPU defaults", "",
             f"`{command}` on {harness.describe(env)}. Each run is `grpo-fast train` (the default run: SmolLM2-135M-Instruct, "
             "20 steps of 8 prompts x 8 completions, five held-out evaluations of 200 questions), timed from start to exit "
             "(`make train` adds only its setup check).", "",
             "| run | precision (resolved) | wall (min) | step (s) | generate | old-policy pass | train | sync | evals (s) "
             "| accuracy step 0 | step 20 | gain (points) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in sorted(runs.items()):
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][-200:]!r} | | | | | | | | | | |")
            continue
        p, (_, a0), (_, a1) = r["parts_s"], r["eval_history"][0], r["eval_history"][-1]
        lines.append(f"| {name} | {r['precision_line'] or '?'} | {r['wall_s'] / 60:.1f} | {r['mean_step_s']:.1f} | "
                     f"{p['time/generate']:.1f} | {p['time/logprob']:.1f} | {p['time/train']:.1f} | "
                     f"{p['time/weight_sync'] + p['time/sync_check']:.1f} | {r['eval_s']:.0f} | {a0:.1%} | {a1:.1%} | "
                     f"{100 * (a1 - a0):+.1f} |")
    paired = [s for s in seeds if f"float32:{s}" in ok and f"bf16:{s}" in ok]
    if paired:
        lines += ["", "| seed | bf16 / float32: wall | step | generation per token | train per token | mean answer length "
                  "(tokens) | accuracy bf16 - float32 (points) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in paired:
            f, b = ok[f"float32:{s}"], ok[f"bf16:{s}"]
            lines.append(f"| {s} | {b['wall_s'] / f['wall_s']:.2f} | {b['mean_step_s'] / f['mean_step_s']:.2f} | "
                         f"{f['generated_tokens_per_s'] / b['generated_tokens_per_s']:.2f} | "
                         f"{b['train_ms_per_token'] / f['train_ms_per_token']:.2f} | "
                         f"{b['mean_completion_length']:.1f} vs {f['mean_completion_length']:.1f} | "
                         f"{100 * (b['eval_history'][-1][1] - f['eval_history'][-1][1]):+.1f} |")
    for precision in PRECISIONS:
        final = [ok[n]["eval_history"][-1][1] for n in ok if n.startswith(precision + ":")]
        if final:
            lines.append(f"\n{precision}: final held-out accuracy {', '.join(f'{a:.1%}' for a in final)} "
                         f"(mean {sum(final) / len(final):.1%}, spread {max(final) - min(final):.1%}).")
    notes = [f"- {name}: {r['note']}" for name, r in sorted(ok.items()) if r.get("note")]
    if notes:  # written by hand into a run folder's `note` file: what the figures above cannot say
        lines += ["", "Notes on single runs:", *notes]
    lines += ["", "![held-out accuracy over wall-clock minutes](precision_cpu.png)"]
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in sorted(runs.items()):
        if "error" in r:
            continue
        # evaluations are evenly spread over the run's steps: place them on its wall-clock axis
        steps = max(s for s, _ in r["eval_history"]) or 1
        xs = [r["wall_s"] / 60 * s / steps for s, _ in r["eval_history"]]
        ax.plot(xs, [a for _, a in r["eval_history"]], "o-" if name.startswith("bf16") else "s--", label=name)
    ax.set_xlabel("wall-clock minutes (evaluations placed by step)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1])
    parser.add_argument("--only", nargs="+", help="runs to (re)do, as precision:seed (float32:42 bf16:1 ...)")
    parser.add_argument("--report_only", action="store_true",
                        help="rewrite the report from the run folders in --workdir (precision_seedS/, each with its wall_s)")
    parser.add_argument("--workdir", default="/tmp/grpo_fast_bench_precision")
    parser.add_argument("--timeout_min", type=float, default=45)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    kept = workdir / "runs.json"
    runs = json.loads(kept.read_text()) if kept.exists() else {}
    if args.report_only:
        runs.update({d.name.replace("_seed", ":"): collect(d) for d in sorted(workdir.glob("*_seed*")) if (d / "wall_s").exists()})
    names = [] if args.report_only else args.only or [f"{p}:{s}" for s in args.seeds for p in PRECISIONS]
    for name in names:
        if name.split(":")[0] not in PRECISIONS:
            parser.error(f"--only {name}: expected precision:seed with precision one of {list(PRECISIONS)}")
    env = harness.environment()
    for name in names:
        try:
            runs[name] = run_one(name, workdir, args.timeout_min)
        except subprocess.TimeoutExpired:
            runs[name] = {"error": f"over {args.timeout_min} min, stopped"}
        workdir.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(runs, indent=1))
        print(f"[bench_precision] {name}: {json.dumps({k: v for k, v in runs[name].items() if 'history' not in k})}",
              flush=True)
    command = harness.whole_run_command(__file__)
    harness.write_results(OUT, {"command": command, "environment": env, "runs": runs}, markdown(runs, command, env))
    plot(runs, OUT.with_suffix(".png"))
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()

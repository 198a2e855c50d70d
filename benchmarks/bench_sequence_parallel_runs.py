"""Sequence parallelism's runs beyond the suite, each against one process with the same global batch: the trainer
(tests/distributed/train_ranks.py: the tiny Llama of tests/tiny_model.py, float32, 16 completions a step, 2 steps)
on the layouts and options the suite leaves out. Writes results/sequence_parallel_runs_cpu.{md,json}.

    python benchmarks/bench_sequence_parallel_runs.py                 # every run (about 15 min on 2 cores)
    python benchmarks/bench_sequence_parallel_runs.py --only dp2xsp2  # some of them

Each row: the largest relative difference of a logged metric (but timings, the engine-trainer log-prob gaps, float
noise of ~1e-6 on both sides, and values below 1e-6 on both sides), and of the update,
||w_ranks - w_one|| / ||w_one - w_start||.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sequence_parallel_runs_cpu"
SCRIPT = str(ROOT / "tests" / "distributed" / "train_ranks.py")
NOISE = ("sampling/logp_diff_mean", "sampling/logp_diff_max", "sampling/sync_check_diff")
SEQUENCE = ["loss_type=luspo", "importance_sampling_level=sequence", "num_iterations=2", "beta=0.05"]
# name: (ranks, per-rank completions, engine, the ranks' options, options of both, torchrun's extra arguments, what)
RUNS = {
    "dp2xsp2": (4, 4, "hf", ["distributed_strategy=ddp", "sequence_parallel_size=2"], [], [],
                "4 ranks: 2 data-parallel groups of 2, dapo, DDP"),
    "dp2xsp2-fsdp2": (4, 4, "hf", ["distributed_strategy=fsdp2", "sequence_parallel_size=2", "gradient_checkpointing=True"],
                      SEQUENCE, [], "4 ranks, FSDP2, luspo with sequence ratios, beta 0.05, num_iterations 2, checkpointing "
                                    "(one process without: its checkpointing takes the dense mask)"),
    "agents": (2, 8, "hf", ["distributed_strategy=ddp", "sequence_parallel_size=2"], ["tool_model={tool}"], [],
               "agents: the tiny tool-calling model, multi-turn trajectories with tool results masked"),
    "trl-masks": (2, 8, "hf", ["distributed_strategy=ddp", "sequence_parallel_size=2"],
                  ["top_entropy_quantile=0.5", "off_policy_mask_threshold=0.5", "entropy_coef=0.01",
                   "use_adaptive_entropy=True"], [],
                  "TRL's high-entropy and off-policy masks, the adaptive entropy bonus"),
    "vllm-is": (2, 8, "vllm", ["distributed_strategy=ddp", "sequence_parallel_size=2"],
                ["vllm_importance_sampling_correction=True"], [],
                "a vLLM engine per rank, IS weights from the step's own (sharded) forward"),
    "killed-resumed": (2, 8, "hf", ["distributed_strategy=ddp", "sequence_parallel_size=2", "kill_rank_after_step=1:2"],
                       [], ["--max-restarts", "1"],
                       "rank 1 killed (SIGKILL) after step 2's update; torchrun restarts both, which resume from "
                       "checkpoint-1 by themselves"),
}


def train(ranks: int, per_device: int, engine: str, options: list[str], out: Path, model: str, torchrun: list[str]):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *torchrun]
    start = time.perf_counter()
    done = subprocess.run([*launcher, SCRIPT, model, str(out), str(per_device), engine, *options], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{out.name}: {done.stderr[-3000:]}")
    seen = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]  # rank 0's line: world, steps, attempt
    return time.perf_counter() - start, seen[-1]


def compare(one: Path, ranks: Path, initial: dict) -> dict:
    from safetensors.torch import load_file

    rows1, rows2 = ([json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] for p in (one, ranks))
    worst, name, names = 0.0, None, 0
    for a, b in zip(rows1, rows2, strict=True):
        assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
        for key, value in a.items():
            if key.startswith("time/") or key in ("step_time", "tokens_per_second", *NOISE) or key.endswith("time_waiting") \
                    or isinstance(value, (bool, str)) or not isinstance(value, (int, float)):
                continue
            if max(abs(value), abs(b[key])) < 1e-6:  # (a loss of ~1e-7 on both sides: its relative difference is noise)
                continue
            names += 1
            diff = abs(b[key] - value) / max(abs(value), 1e-12) if abs(b[key] - value) > 1e-12 else 0.0
            if diff > worst:
                worst, name = diff, f"{key} (step {a['step']})"
    w1, w2 = (load_file(p / "final" / "model.safetensors") for p in (one, ranks))
    diff = sum(float(((w2[n] - w) ** 2).sum()) for n, w in w1.items()) ** 0.5
    update = sum(float(((w - initial[n]) ** 2).sum()) for n, w in w1.items()) ** 0.5
    return {"metric_rel": worst, "metric": name, "metrics_compared": names, "update_rel": diff / update,
            "noise": {k: (rows1[-1].get(k), rows2[-1].get(k)) for k in NOISE if k in rows1[-1]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--report", action="store_true", help="rewrite the report from the saved json (no runs)")
    args = parser.parse_args()
    if args.report:
        return report(json.loads(OUT.with_suffix(".json").read_text()))
    from safetensors.torch import load_file

    from grpo_fast.generation.engines import vllm_available
    from tests.agents.tool_model import build_tool_model
    from tests.tiny_model import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"tiny": build_tiny_model(tmp / "tiny")}
        build_tool_model(str(tmp / "tool"))
        models["tool"] = str(tmp / "tool")
        for name in args.only:
            ranks, per_device, engine, layout, both, torchrun, what = RUNS[name]
            if engine == "vllm" and not vllm_available():
                results.append({"name": name, "what": what, "skipped": "vllm is not installed"})
                continue
            both = [o.format(**models) for o in both]
            model = models["tool"] if any(o.startswith("tool_model=") for o in both) else models["tiny"]
            s1, _ = train(1, ranks * per_device, engine, both, tmp / f"{name}-one", model, [])
            s2, seen = train(ranks, per_device, engine, [*layout, *both], tmp / f"{name}-ranks", model, torchrun)
            row = {"name": name, "what": what, "ranks": ranks, "options": [*layout, *both], "seconds": [s1, s2],
                   "ranks_said": seen,
                   **compare(tmp / f"{name}-one", tmp / f"{name}-ranks", load_file(Path(model) / "model.safetensors"))}
            results.append(row)
            print(json.dumps(row), flush=True)
    result = {"command": harness.command_line("benchmarks/bench_sequence_parallel_runs.py"),
              "environment": harness.environment(), "runs": results}
    if set(args.only) != set(RUNS) and OUT.with_suffix(".json").exists():  # (some runs again: the others as saved)
        saved = json.loads(OUT.with_suffix(".json").read_text())
        again = {r["name"]: r for r in results}
        result = {**saved, "runs": [again.get(r["name"], r) for r in saved["runs"]],
                  "rerun": {"command": result["command"], "runs": sorted(again)}}
    report(result)


def report(result: dict) -> None:
    lines = ["# Sequence parallelism: runs against one process (CPU, gloo)", "", f"Command: `{result['command']}`", "",
             harness.describe(result["environment"]), "", __doc__.split("\n\n")[0].replace("\n", " "), "",
             "| run | ranks | what | largest metric difference (relative) | update difference (relative) | s: one / ranks "
             "| torchrun restarts before the run finished |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | | {r['what']} | skipped: {r['skipped']} | | | |")
            continue
        lines.append(f"| {r['name']} | {r['ranks']} | {r['what']} | {r['metric_rel']:.1e} ({r['metric']}; "
                     f"{r['metrics_compared']} values) | {r['update_rel']:.1e} | {r['seconds'][0]:.0f} / {r['seconds'][1]:.0f} "
                     f"| {(r.get('ranks_said') or {}).get('attempt', '')} |")
    if "rerun" in result:
        lines += ["", f"Rerun since (`{result['rerun']['command']}`): {', '.join(result['rerun']['runs'])}."]
    lines += ["", "Not run: a partial-rollout run resumed after kill -9 on the sequence-parallel layout. Partial rollouts "
              "run in one process only (config_checks refuses max_staleness > 0 under torchrun, sequence parallelism or "
              "not); the killed-resumed row is the same kill -9 and resume on the sequence-parallel layout without them."]
    harness.write_results(OUT, result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

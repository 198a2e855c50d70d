"""What the sandbox costs a program, and a short HumanEval run on the default model.

    python benchmarks/bench_sandbox.py                    # writes benchmarks/results/sandbox_cpu.{json,md}
    python benchmarks/bench_sandbox.py --programs 50 --steps 10 --skip-train

(a) Start-up: the same trivial program (`pass`) run N times bare (`python3 -I -c pass`), under bubblewrap
with the sandbox's limits (grpo_fast.sandbox), and the sandbox's own start-up (until bwrap had the
program's process running, from its --json-status-fd). (b) Throughput: 32 programs that sleep 0.5 s on a
pool of 8. (c) Training: the `humaneval` task with `code_tests` on SmolLM2-135M-Instruct for a few steps:
held-out pass@1 (greedy) before and after, and the sandbox counters per step. A 135M model scores near
zero on HumanEval; the run shows that the loop completes with the counters logged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def startup(n: int) -> dict:
    from grpo_fast.sandbox import Sandbox, SandboxOptions

    bare = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-I", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
    box = Sandbox(SandboxOptions(workers=1))
    boxed = [box.run("pass") for _ in range(n)]
    assert all(r.ok for r in boxed)
    ms = lambda xs: round(1000 * statistics.median(xs), 2)
    return {"programs": n, "bare_python_ms": ms(bare), "sandboxed_python_ms": ms([r.seconds for r in boxed]),
            "bwrap_start_ms": ms([r.start_seconds for r in boxed])}


def pool() -> dict:
    from grpo_fast.sandbox import Sandbox, SandboxOptions

    box = Sandbox(SandboxOptions(workers=8))

    async def run():
        return await asyncio.gather(*(box.run_async("import time; time.sleep(0.5)") for _ in range(32)))

    start = time.perf_counter()
    results = asyncio.run(run())
    return {"programs": 32, "workers": 8, "sleep_s": 0.5, "wall_s": round(time.perf_counter() - start, 2),
            "all_ok": all(r.ok for r in results)}


def train(args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer

    out = Path(args.workdir) / "humaneval"
    c = GRPOConfig(task="humaneval", reward_funcs=["code_tests"], num_generations=args.n,
                   per_device_train_batch_size=args.prompts * args.n, max_completion_length=args.max_new_tokens,
                   max_steps=args.steps, output_dir=str(out), overwrite_output_dir=True, disable_tqdm=True,
                   save_final=False, eval_steps=0, report_to="none", learning_rate=1e-5, task_train_size=124,
                   eval_max_samples=40, eval_max_completion_length=args.max_new_tokens)
    start = time.perf_counter()
    GRPOTrainer.from_config(c).train()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "loss" in r]
    keys = ("reward", "sandbox/seconds", "sandbox/start_seconds", "sandbox/timeouts", "sandbox/oom",
            "sandbox/process_limit", "sandbox/output_limit", "code/no_code", "code/syntax_errors", "step_time")
    return {"wall_s": round(time.perf_counter() - start, 1),
            "pass@1_before": evals[0].get("eval/pass@1") if evals else None,
            "pass@1_after": evals[-1].get("eval/pass@1") if evals else None,
            "steps": [{k: s.get(k) for k in ("step", *keys)} for s in steps]}


def markdown(r: dict) -> str:
    s, p = r["startup"], r["pool"]
    lines = ["# The sandbox: start-up, a pool, and a short HumanEval run", "", f"Command: `{r['command']}`", "",
             f"Machine: {r['machine']}.", "",
             f"(a) A trivial program, median of {s['programs']}: bare `python3 -I -c pass` {s['bare_python_ms']} ms, "
             f"sandboxed {s['sandboxed_python_ms']} ms (bwrap's own start-up {s['bwrap_start_ms']} ms, until the "
             f"program's process runs).", "",
             f"(b) {p['programs']} programs sleeping {p['sleep_s']} s on {p['workers']} workers: {p['wall_s']} s "
             f"(ideal {p['programs'] * p['sleep_s'] / p['workers']:.1f} s).", ""]
    t = r.get("train")
    if t:
        lines += [f"(c) humaneval with code_tests on SmolLM2-135M-Instruct, {len(t['steps'])} steps ({r['train_setup']}): "
                  f"held-out pass@1 {t['pass@1_before']} before, {t['pass@1_after']} after ({t['wall_s']} s).", "",
                  "| step | reward | step s | sandbox s | start s | timeouts | oom | process limit | output limit | no code | syntax errors |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in t["steps"]:
            lines.append("| " + " | ".join(f"{row.get(k):.3g}" if isinstance(row.get(k), float) else str(row.get(k)) for k in
                         ("step", "reward", "step_time", "sandbox/seconds", "sandbox/start_seconds", "sandbox/timeouts",
                          "sandbox/oom", "sandbox/process_limit", "sandbox/output_limit", "code/no_code",
                          "code/syntax_errors")) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--workdir", default="/tmp/grpo_fast_bench_sandbox")
    args = parser.parse_args()
    env = harness.environment()
    report = {"command": harness.command_line(__file__), "machine": harness.describe(env), "environment": env,
              "startup": startup(args.programs), "pool": pool(),
              "train_setup": f"{args.prompts} prompts x {args.n} completions, up to {args.max_new_tokens} tokens, lr 1e-5"}
    harness.write_results(RESULTS / "sandbox_cpu", report, markdown(report))
    if not args.skip_train:
        report["train"] = train(args)
        harness.write_results(RESULTS / "sandbox_cpu", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

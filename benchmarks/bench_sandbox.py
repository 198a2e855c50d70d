"""What the sandbox costs a program, a busy pool, code_tests' harness, and a short HumanEval run on the default model.

    python benchmarks/bench_sandbox.py                    # writes benchmarks/results/sandbox_cpu.{json,md}
    python benchmarks/bench_sandbox.py --programs 50 --steps 10 --skip-train

(a) Start-up: the same trivial program (`pass`) run N times bare (`python3 -I -c pass`), under bubblewrap
with the sandbox's limits (grpo_fast.rewards.sandbox), and the sandbox's own start-up (until bwrap had the
program's process running, from its --json-status-fd). (b) Throughput: 32 programs that sleep 0.5 s on a
pool of 8. (d) A busy pool: 32 CPU-bound programs of 0.3 to 0.9 s of CPU submitted at once, on 4 x cores
workers charged wall time in full (the pool and clock before issue 46), on 4 x cores workers with the clock
that does not charge time spent waiting for a core, and on the default pool (one program a usable core); the
target is one program's time alone x 32 / cores. (e) code_tests' harness: HumanEval's canonical solutions
scored (a program, its harness process and the tests' calls through it), per program. (c) Training: the
`humaneval` task with `code_tests` on SmolLM2-135M-Instruct for a few steps: held-out pass@1 (greedy) before
and after, and the sandbox counters per step. A 135M model scores near zero on HumanEval; the run shows that
the loop completes with the counters logged. With --skip-train, (c) is kept from the results file as it was.
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

from grpo_fast.rewards.sandbox import Sandbox, SandboxOptions  # noqa: E402 (after the path)


def startup(n: int) -> dict:
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
    box = Sandbox(SandboxOptions(workers=8))

    async def run():
        return await asyncio.gather(*(box.run_async("import time; time.sleep(0.5)") for _ in range(32)))

    start = time.perf_counter()
    results = asyncio.run(run())
    return {"programs": 32, "workers": 8, "sleep_s": 0.5, "wall_s": round(time.perf_counter() - start, 2),
            "all_ok": all(r.ok for r in results)}


def busy_program(cpu_s: float) -> str:
    return (f"import time\nend = time.process_time() + {cpu_s}\nwhile time.process_time() < end:\n    pass\n"
            f"print('done')")


def busy_pool(timeout: float = 2.5) -> dict:
    """32 programs of 0.3 to 0.9 s of CPU at once under three pools; wall time for all, timeouts at `timeout` s."""
    import grpo_fast.rewards.sandbox as sandbox

    cores = sandbox.usable_cores()
    cpu = [0.3 + 0.6 * k / 31 for k in range(32)]
    alone = Sandbox(SandboxOptions(timeout=30, workers=1))
    one = statistics.median(alone.run(busy_program(statistics.mean(cpu))).seconds for _ in range(3))
    alone.close()
    runs, waited = {}, sandbox._waited
    for name, workers, credit in (("4 x cores, wall charged in full (before)", 4 * cores, False),
                                  ("4 x cores, waiting not charged", 4 * cores, True),
                                  ("one a core, waiting not charged (default)", None, True)):
        sandbox._waited = waited if credit else (lambda pid: 0.0)  # (the clock as it was: every second charged)
        box = Sandbox(SandboxOptions(timeout=timeout, cpu_seconds=5, workers=workers))

        async def run(box):
            return await asyncio.gather(*(box.run_async(busy_program(c)) for c in cpu))

        start = time.perf_counter()
        results = asyncio.run(run(box))
        wall = time.perf_counter() - start
        box.close()
        runs[name] = {"workers": box.options.pool_size, "wall_s": round(wall, 2),
                      "timeouts": sum(r.reason == "timeout" for r in results),
                      "longest_program_s": round(max(r.seconds for r in results), 2), "all_ok": all(r.ok for r in results)}
    sandbox._waited = waited
    return {"programs": 32, "cpu_s": [0.3, 0.9], "cores": cores, "timeout_s": timeout, "one_alone_s": round(one, 3),
            "target_s": round(one * 32 / cores, 2), "pools": runs}


def harness_cost() -> dict:
    """HumanEval's 164 canonical solutions through code_tests (all mode) on the default pool: wall per program."""
    from grpo_fast.data.tasks import humaneval_rows
    from grpo_fast.rewards.code import CodeTests

    rows = humaneval_rows(split="train") + humaneval_rows(split="test")
    reward = CodeTests(SandboxOptions(timeout=30))
    start = time.perf_counter()
    values = asyncio.run(reward([r["prompt"] for r in rows], [r["canonical_solution"] for r in rows],
                                test=[r["test"] for r in rows], entry_point=[r["entry_point"] for r in rows]))
    wall = time.perf_counter() - start
    seconds = reward.metrics()["sandbox/seconds"]
    return {"programs": len(rows), "passed": sum(v == 1.0 for v in values), "workers": reward.sandbox.options.pool_size,
            "wall_s": round(wall, 2), "per_program_ms": round(1000 * seconds / len(rows), 1)}


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
    b, h = r.get("busy"), r.get("harness")
    if b:
        lines += [f"(d) {b['programs']} CPU-bound programs of {b['cpu_s'][0]} to {b['cpu_s'][1]} s of CPU submitted at "
                  f"once, {b['cores']} usable cores, wall limit {b['timeout_s']} s; one program of the mean alone "
                  f"{b['one_alone_s']} s, so the target is {b['target_s']} s (x 32 / cores). Load average when the "
                  f"benchmark started: {r['environment']['load_average']} (a shared machine: where other jobs run, more "
                  f"workers take a larger share of it, and one program alone takes longer).", "",
                  "| pool | workers | wall for all 32 s | timeouts | longest program s |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {x['workers']} | {x['wall_s']} | {x['timeouts']} | {x['longest_program_s']} |"
                  for name, x in b["pools"].items()]
        lines.append("")
    if h:
        lines += [f"(e) code_tests' harness: HumanEval's {h['programs']} canonical solutions, {h['passed']} scored 1.0; "
                  f"{h['per_program_ms']} ms a program in the sandbox (the harness, the program's own interpreter, the "
                  f"tests' calls between them), {h['wall_s']} s for all on {h['workers']} workers.", ""]
    t = r.get("train")
    if t:
        kept = f" Recorded earlier ({r['train_recorded']}), before the harness of issue 46." if r.get("train_recorded") else ""
        lines += [f"(c) humaneval with code_tests on SmolLM2-135M-Instruct, {len(t['steps'])} steps ({r['train_setup']}): "
                  f"held-out pass@1 {t['pass@1_before']} before, {t['pass@1_after']} after ({t['wall_s']} s).{kept}", "",
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
              "startup": startup(args.programs), "pool": pool(), "busy": busy_pool(), "harness": harness_cost(),
              "train_setup": f"{args.prompts} prompts x {args.n} completions, up to {args.max_new_tokens} tokens, lr 1e-5"}
    earlier = RESULTS / "sandbox_cpu.json"
    if args.skip_train and earlier.exists():  # (the training run is minutes: keep the last one, saying so)
        before = json.loads(earlier.read_text())
        if "train" in before:
            report.update(train=before["train"], train_setup=before["train_setup"],
                          train_recorded=before.get("train_recorded") or before["machine"])
    harness.write_results(RESULTS / "sandbox_cpu", report, markdown(report))
    if not args.skip_train:
        report["train"] = train(args)
        harness.write_results(RESULTS / "sandbox_cpu", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""What a generative judge costs a GRPO step: the default task (arithmetic, SmolLM2-135M-Instruct) with the
`math` reward alone, and with a judge beside it (SmolLM2-135M-Instruct itself, from its registry package,
on a vLLM engine of its own), side by side.

    python benchmarks/bench_judge.py               # writes benchmarks/results/judge_cpu.{json,md}
    python benchmarks/bench_judge.py --steps 3 --prompts 4 --n 8 --max-new-tokens 96

Columns: math; math + judge_score (one judge request per completion, an answer of one number in 0-10);
math + judge_rank (one request per group, all members side by side, one score each). Each column in its own
process (a fresh policy engine and judge); the first step is a warm-up, the others are averaged. The judge
decodes under its answer format (structured outputs). With the vLLM policy engine each group is scored as
soon as its last completion ends, while the others still decode: `time/reward` is what scoring adds after
decoding; `judge/seconds` is the judge's own time, most of it inside `time/generate` (the two vLLM engines
take turns step by step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = {"math": ["math"], "judge_score": ["math", "judge_score"], "judge_rank": ["math", "judge_rank"]}
PARTS = ("time/generate", "time/reward", "time/logprob", "time/train", "time/weight_sync")
JUDGE = ("judge/seconds", "judge/tokens", "judge/requests", "judge/unparsable")


def child(name: str, args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer

    out = Path(args.workdir) / name
    c = GRPOConfig(reward_funcs=COLUMNS[name], judge_model="default" if name != "math" else None,
                   num_generations=args.n, per_device_train_batch_size=args.prompts * args.n,
                   max_completion_length=args.max_new_tokens, max_steps=args.steps, output_dir=str(out),
                   overwrite_output_dir=True, disable_tqdm=True, save_final=False, eval_before_train=False,
                   eval_steps=0, sampling_check_steps=0, report_to="none", task_train_size=200)
    start = time.perf_counter()
    trainer = GRPOTrainer.from_config(c)
    build = time.perf_counter() - start
    trainer.train()
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step_time"' in line]
    timed = records[1:] or records
    mean = lambda key: sum(r.get(key) or 0.0 for r in timed) / len(timed)
    return {"engine": type(trainer.engine).__name__, "build_s": build, "steps_timed": len(timed),
            "step_time_s": mean("step_time"), "parts_s": {p: mean(p) for p in PARTS},
            "judge": {k: mean(k) for k in JUDGE} if name != "math" else None,
            "reward": mean("reward"), "mean_completion_length": mean("completions/mean_length"),
            "judge_reward_mean": mean(f"rewards/{COLUMNS[name][-1]}/mean") if name != "math" else None}


def markdown(report: dict) -> str:
    lines = ["# What a judge costs a GRPO step", "", f"Command: `{report['command']}`", "",
             f"{report['setup']}. Machine: {report['machine']}.", "",
             "| | step (s) | generate | reward | logprob | train | sync | judge s | judge tokens | judge requests | unparsable | mean length |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in report["columns"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][-200:]!r} |")
            continue
        p, j = r["parts_s"], r["judge"] or {}
        judge = (f"{j['judge/seconds']:.1f} | {j['judge/tokens']:.0f} | {j['judge/requests']:.0f} | {j['judge/unparsable']:.0f}"
                 if j else "- | - | - | -")
        lines.append(f"| {name} | {r['step_time_s']:.1f} | " + " | ".join(f"{p[k]:.1f}" for k in PARTS)
                     + f" | {judge} | {r['mean_completion_length']:.0f} |")
    base = report["columns"].get("math", {})
    for name in ("judge_score", "judge_rank"):
        r = report["columns"].get(name, {})
        if "step_time_s" in r and "step_time_s" in base:
            lines.append(f"\n{name}: {r['step_time_s'] / base['step_time_s']:.2f}x the step time of math alone "
                         f"(+{r['step_time_s'] - base['step_time_s']:.1f} s; the judge's own {r['judge']['judge/seconds']:.1f} s, "
                         f"{r['parts_s']['time/reward']:.1f} s of it after decoding ended).")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per column (the first is a warm-up)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--only", nargs="*", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--workdir", default="/tmp/grpo_fast_bench_judge")
    parser.add_argument("--timeout-min", type=float, default=30)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(child(args.child, args)) + "\n")
        return
    runs = Path(args.workdir) / "runs"
    extra = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
             "--max-new-tokens", str(args.max_new_tokens), "--workdir", args.workdir]
    env = harness.environment()
    harness.run_children(__file__, args.only, extra, runs, args.timeout_min)
    columns = {name: json.loads((runs / f"{name}.json").read_text()) for name in args.only}
    report = {"command": harness.command_line(__file__), "machine": harness.describe(env), "environment": env,
              "setup": (f"{args.prompts} arithmetic prompts x {args.n} completions, up to {args.max_new_tokens} new tokens, "
                        f"{args.steps} steps (the first a warm-up), the run's defaults otherwise; judge = policy model "
                        f"(SmolLM2-135M-Instruct) on its own vLLM engine, greedy, structured output"),
              "columns": columns}
    harness.write_results(RESULTS / "judge_cpu", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

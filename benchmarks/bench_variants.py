"""The GRPO variants beside plain GRPO on SmolLM2-135M-Instruct, same seed (42), a small step budget.

    python benchmarks/bench_variants.py                  # every configuration, ~7-9 min each on 2 CPU cores
    python benchmarks/bench_variants.py --only lead s_grpo   # some of them (the others' earlier results are kept)

Writes benchmarks/results/variants/variants.{md,json,png}; each configuration runs in a subprocess of
its own (a fresh vLLM engine, nothing shared) and its result is kept in runs/<name>.json as soon as it
ends, so an interrupted run loses only the configuration in flight.

What each row is (the default run's settings otherwise: lr 1e-5, vLLM engine, 64 tokens):
  grpo seed 42 / 0 / 1     plain GRPO at the variants' seed (42, the default), and at two more seeds for
                           the seed-to-seed spread (the seed also picks the 200 held-out prompts of 290)
  lead                     GRPO-LEAD: reward_funcs [lead] (length-dependent accuracy), difficulty_weighting
  s_grpo                   S-GRPO: rollout_mode early_exit, m = 7 cuts + the full completion
  grpo_ma                  GRPO-MA: rollout_mode multi_answer, K = 4 thoughts x M = 4 answers (thought_end \\boxed{)
  grpo, 20% flipped        plain GRPO, each training reward flipped 0 <-> 1 with probability 0.2 (seeded)
  stable_grpo, 20% flipped Stable GRPO: the same flipped rewards, reward_noise_rate 0.2
  chain: grpo / sgpo       chain_arithmetic (three operations, 128 tokens): plain GRPO, and SGPO partial
                           credit from the chain_steps judge on groups with no right answer
  chain: tools             the same with the calculator tool (rollout_mode multi_turn; the prompt shows one
                           worked call; tool results count in the 128 tokens): tool calls per trajectory
                           held out before / after and in training
Held-out evaluation (greedy, clean rewards) before and after: accuracy (share of first reward > 0),
mean completion length and that of the right answers; training: completion length and the grad-norm's
mean, std and max over the steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

OUT = ROOT / "benchmarks" / "results" / "variants"
FLIP_RATE = 0.2
ARITH = dict(task="arithmetic")
CHAIN = dict(task="chain_arithmetic", max_completion_length=128, eval_max_samples=100)
# name -> (label, config overrides, flip the training rewards)
CONFIGS = {
    "grpo_seed42": ("grpo (seed 42)", dict(ARITH, seed=42), False),
    "grpo_seed0": ("grpo (seed 0: the spread)", dict(ARITH, seed=0), False),
    "grpo_seed1": ("grpo (seed 1: the spread)", dict(ARITH, seed=1), False),
    "lead": ("GRPO-LEAD: lead reward + difficulty weights", dict(ARITH, reward_funcs=["lead"], difficulty_weighting=True), False),
    "s_grpo": ("S-GRPO: early exit (m=7)", dict(ARITH, rollout_mode="early_exit", early_exit_points=7), False),
    "grpo_ma": ("GRPO-MA: 4 thoughts x 4 answers", dict(ARITH, rollout_mode="multi_answer", num_generations=4,
                                                         answers_per_thought=4, thought_end="\\boxed{"), False),
    "grpo_flipped": ("grpo, 20% flipped rewards", dict(ARITH), True),
    "stable_grpo_flipped": ("Stable GRPO (p=0.2), 20% flipped rewards", dict(ARITH, reward_noise_rate=FLIP_RATE), True),
    "chain_grpo": ("chain_arithmetic: grpo", dict(CHAIN), False),
    "chain_sgpo": ("chain_arithmetic: SGPO partial credit (chain_steps)", dict(CHAIN, partial_credit_judge="chain_steps"), False),
    "chain_tools": ("chain_arithmetic: grpo, calculator tool (agents)", dict(CHAIN, tools=["calculator"]), False),
}


class Flipped:
    """The wrapped reward with each 0/1 value flipped with probability `rate` while `enabled` (training
    only: evaluation reads the clean reward). Seeded: the same run flips the same completions."""

    def __init__(self, func, rate: float, seed: int):
        self.func, self.rate, self.enabled, self.rng = func, rate, True, random.Random(seed)
        self.__name__ = getattr(func, "__name__", "math")  # metrics keep the reward's own name

    def __call__(self, *args, **kwargs):
        values = self.func(*args, **kwargs)
        if not self.enabled:
            return values
        return [v if v is None or self.rng.random() >= self.rate else 1.0 - v for v in values]


def run_one(name: str, steps: int, prompts: int, result_path: str) -> None:
    """One configuration, in this process: train, evaluate before and after, write its numbers."""
    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer

    _, overrides, flip = CONFIGS[name]
    out = tempfile.mkdtemp(prefix=f"bench_variants_{name}_")
    group = overrides.get("num_generations", 8)
    if overrides.get("rollout_mode") == "multi_answer":  # K thoughts and K x M answers per prompt
        group *= 1 + overrides["answers_per_thought"]
    config = GRPOConfig.from_dict({}, max_steps=steps, per_device_train_batch_size=prompts * group,
                                  eval_steps=0, save_final=False, disable_tqdm=True, output_dir=os.path.join(out, "run"),
                                  **overrides)
    start = time.perf_counter()
    trainer = GRPOTrainer.from_config(config)
    if flip:
        flipped = Flipped(trainer.reward_funcs[0], FLIP_RATE, config.seed)
        trainer.reward_funcs[0] = flipped
        evaluate = trainer.evaluate

        def clean_evaluate(rows=None):
            flipped.enabled = False
            try:
                return evaluate(rows)
            finally:
                flipped.enabled = True

        trainer.evaluate = clean_evaluate
    trainer.train()
    wall = time.perf_counter() - start
    with open(trainer.metrics_logger.path) as f:
        lines = [json.loads(line) for line in f]
    evals = [x for x in lines if "eval/accuracy" in x]
    steps_ = [x for x in lines if "loss" in x]
    grad = [x["grad_norm"] for x in steps_ if math.isfinite(x.get("grad_norm", math.nan))]
    mean = sum(grad) / len(grad)
    result = dict(
        name=name, label=CONFIGS[name][0], overrides=overrides, flipped_rewards=flip, steps=steps, prompts_per_step=prompts,
        wall_s=round(wall, 1),
        eval_before={k: v for k, v in evals[0].items() if k.startswith("eval/")},
        eval_after={k: v for k, v in evals[-1].items() if k.startswith("eval/")},
        train_length=[x["completions/mean_length"] for x in steps_],
        train_reward=[x["reward"] for x in steps_],
        train_tool_calls=[x["tools/call_frequency"] for x in steps_ if "tools/call_frequency" in x],
        grad_norm=grad, grad_norm_mean=mean, grad_norm_std=math.sqrt(sum((g - mean) ** 2 for g in grad) / max(len(grad) - 1, 1)),
        grad_norm_max=max(grad),
    )
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n")


def _fmt(x, spec=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(results: list[dict]) -> list[str]:
    lines = ["| configuration | held-out accuracy before → after | eval length (all / right), after | train length, first → last step | "
             "grad-norm mean ± std (max) | wall |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b, a = r["eval_before"], r["eval_after"]
        extra = "".join(f"; {k[5:]} {_fmt(b[k])} → {_fmt(a[k])}"
                        for k in ("eval/accuracy_boxed", "eval/step_score", "eval/tools/call_frequency") if k in a)
        if r.get("train_tool_calls"):
            extra += f"; training tools/call_frequency {_fmt(r['train_tool_calls'][0])} → {_fmt(r['train_tool_calls'][-1])}"
        lines.append(
            f"| {r['label']} | {_fmt(b['eval/accuracy'])} → **{_fmt(a['eval/accuracy'])}**{extra} | "
            f"{_fmt(a['eval/completions/mean_length'], '.1f')} / {_fmt(a.get('eval/completions/mean_length_correct'), '.1f')} | "
            f"{_fmt(r['train_length'][0], '.1f')} → {_fmt(r['train_length'][-1], '.1f')} | "
            f"{_fmt(r['grad_norm_mean'], '.3g')} ± {_fmt(r['grad_norm_std'], '.2g')} ({_fmt(r['grad_norm_max'], '.3g')}) | "
            f"{r['wall_s'] / 60:.1f} min |")
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    for r in results:
        ax1.plot([0, r["steps"]], [r["eval_before"]["eval/accuracy"], r["eval_after"]["eval/accuracy"]], "o-", label=r["label"])
        ax2.plot(range(1, len(r["train_length"]) + 1), r["train_length"], label=r["label"])
        ax3.plot(range(1, len(r["grad_norm"]) + 1), r["grad_norm"], label=r["label"])
    ax1.set(title="held-out accuracy (greedy, clean reward)", xlabel="step")
    ax2.set(title="training completion length (tokens)", xlabel="step")
    ax3.set(title="gradient norm (before clipping)", xlabel="step")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run these configurations (default: all)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per configuration")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--timeout_min", type=float, default=30, help="a configuration running longer is stopped and reported")
    parser.add_argument("--report_only", action="store_true", help="only rebuild the table and plot from runs/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_one(args.child, args.steps, args.prompts, args.result)

    runs = OUT / "runs"
    harness.run_children(__file__, [] if args.report_only else args.only or list(CONFIGS),
                         ["--steps", str(args.steps), "--prompts", str(args.prompts)], runs, args.timeout_min)
    results = [json.loads((runs / f"{n}.json").read_text()) for n in CONFIGS if (runs / f"{n}.json").exists()]
    results = [r for r in results if "error" not in r]
    if not results:
        raise SystemExit("bench_variants: no configuration finished")
    env = harness.environment()
    command = harness.whole_run_command(__file__)  # the table covers every configuration in runs/
    lines = [f"# GRPO variants beside plain GRPO: SmolLM2-135M-Instruct, {results[0]['steps']} steps of "
             f"{results[0]['prompts_per_step']} prompts, seed 42", "",
             f"`{command}` on {harness.describe(env)}. Held-out: 200 arithmetic / 100 chain_arithmetic prompts, greedy, "
             f"the clean math reward; accuracy = share of answers whose first reward is > 0. Wall times are on a CPU "
             f"shared with other jobs (tests, other runs): compare them loosely.", ""]
    lines += table(results)
    missing = [CONFIGS[n][0] for n in CONFIGS if n not in {r["name"] for r in results}]
    if missing:
        lines += ["", "Not run yet: " + "; ".join(missing) + "."]
    lines += ["", "![variants](variants.png)"]
    harness.write_results(OUT / "variants", {"command": command, "environment": env, "results": results}, "\n".join(lines))
    plot(results, OUT / "variants.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

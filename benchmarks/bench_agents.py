"""Agent training steps, side by side: grpo_fast's per-trajectory loop (the engine never waits for a tool),
the same engine forced into lock-step turns (every live trajectory's turn, then all their tools, concurrently:
only the scheduling differs), and TRL's GRPOTrainer with the same environment (transformers generation, as TRL
runs on these CPUs).

    python benchmarks/bench_agents.py            # writes benchmarks/results/agents_cpu.{json,md}

The task: the script of the tiny tool-calling model (tests/agents/tool_model.py: add, then mul, then the
answer), where the environment decides how long the chain is: each row draws its number of tool calls from a
geometric distribution (p 1/2, 1 to 6); add and mul answer "(now mul)" until the row's calls are spent, then
"(done)", and the model, trained to call mul after "(now mul)", goes on calling. Every call sleeps the tool
latency first. The same prompts, group size, budgets and model for every column; float32; temperature 1.

Parts: (1) zero latency, `--repeats` interleaved runs of each grpo_fast loop (per-trajectory against
lock-step); (2) the latency set to the median wall time of one batch turn in lock-step (measured in part 1),
both grpo_fast loops, the per-trajectory loop with partial rollouts (max_staleness 1, rollout_overprovision 1:
new prompts' turns decode while the trajectories of the batch wait on their tools), and TRL. Reported per column (medians over the steps after the first): seconds per
trained token (the model's tokens) for the rollout part (generation and tool waits: `time/generate`) and for the
whole step, the engine's busy fraction (of the rollout part, the share not spent waiting with nothing to
decode), and the tool time not overlapped by decoding (that wait over all the tool calls' time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = ("per-trajectory", "per-trajectory, partial rollouts", "lock-step", "TRL")
CONVERSATIONS, TRAIN_STEPS = 48, 150  # the chain model's scripted conversations and full-batch AdamW steps
LATENCY = {"s": 0.0}  # the tool latency of the run going on
TOOL_TIME = {"s": 0.0, "calls": 0}  # summed over every call of the run going on
_lock = threading.Lock()


def chain_calls(index: int) -> int:
    """A row's tool calls: add, then 1 to 5 mul calls, geometric with p 1/2 (seeded by the row)."""
    rng, calls = random.Random(index), 2
    while calls < 6 and rng.random() < 0.5:
        calls += 1
    return calls


class Chain:
    """The environment: add and mul as the script has them, each sleeping the latency; "(now mul)" until the
    row's calls are spent, then "(done)"."""

    def reset(self, calls: int = 1, **row):
        self.left = int(calls)

    def _answer(self, value: int) -> str:
        start = time.perf_counter()
        time.sleep(LATENCY["s"])
        self.left -= 1
        with _lock:
            TOOL_TIME["s"] += time.perf_counter() - start
            TOOL_TIME["calls"] += 1
        return f"{value} ({'now mul' if self.left > 0 else 'done'})"

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return self._answer(int(a) + int(b))

    def mul(self, a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return self._answer(int(a) * int(b))


def answer_reward(completions, answer, **kwargs):
    """The right answer, plus a little per message (a group's rewards differ, so every step has a gradient)."""
    return [float(c[-1]["role"] == "assistant" and c[-1]["content"].strip() == a) + 0.05 * len(c)
            for c, a in zip(completions, answer, strict=True)]


def task_rows(n: int) -> list[dict]:
    from tests.agents.tool_model import tool_prompts

    return [{**row, "calls": chain_calls(i)} for i, row in enumerate(tool_prompts(n, seed=11))]


# ---- grpo_fast ------------------------------------------------------------------------------------


class _LockStep:
    """grpo_fast's loop with turns in lock-step (AgentLoop.run(lockstep=True)) while in effect."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from grpo_fast.generation.agents.loop import AgentLoop

        self.run = AgentLoop.run
        if self.on:
            AgentLoop.run = lambda loop, trajectories, lockstep=False: self.run(loop, trajectories, lockstep=True)

    def __exit__(self, *exc):
        from grpo_fast.generation.agents.loop import AgentLoop

        AgentLoop.run = self.run


def _batch_turns():
    """Wall seconds of every engine.generate call (a lock-step batch turn) while in effect."""
    from grpo_fast.generation.engines.vllm_engine import VLLMEngine

    seen, real = [], VLLMEngine.generate

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = real(self, *args, **kwargs)
        seen.append(time.perf_counter() - start)
        return out

    return seen, real, timed


def run_ours(engine, model_dir: str, rows: list[dict], args, lockstep: bool, out: Path, partial: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.config import GRPOConfig
    from grpo_fast.generation.engines.vllm_engine import VLLMEngine
    from grpo_fast.trainer import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine.update_weights(model)  # (every run starts from the same weights)
    c = GRPOConfig(model=model_dir, reward_funcs=["answer_reward"],
                   num_generations=args.n, per_device_train_batch_size=args.prompts * args.n, max_prompt_length=64,
                   max_completion_length=args.max_completion_length, max_tool_calling_iterations=6, max_steps=args.steps,
                   engine="vllm", vllm_dtype="float32", mixed_precision="no", learning_rate=1e-5, output_dir=str(out),
                   disable_tqdm=True, eval_before_train=False, eval_steps=0, save_steps=0, save_final=False,
                   max_tokens_per_microbatch=4096, tool_timeout=120, seed=0,
                   **(dict(max_staleness=1, rollout_overprovision=1.0) if partial else {}))
    seen, real, timed = _batch_turns()
    TOOL_TIME.update(s=0.0, calls=0)
    VLLMEngine.generate = timed
    try:
        with _LockStep(lockstep):
            trainer = GRPOTrainer(c, [answer_reward], rows, model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                  engine=engine, environment_factory=Chain)
            seen.clear()
            trainer.train()
    finally:
        VLLMEngine.generate = real
    every = [s for s in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in s]
    steps = every[1:]  # (the first step warms up)
    batch = args.prompts * args.n
    per_token = lambda key: statistics.median(s[key] / (s["completions/mean_length"] * batch) for s in steps)  # noqa: E731
    waiting = sum(s["tools/time_waiting"] for s in steps)
    generate = sum(s["time/generate"] for s in steps)
    waiting_all = sum(s["tools/time_waiting"] for s in every)  # (over the steps the tool time was summed over)
    return dict(rollout_s_per_token=per_token("time/generate"), step_s_per_token=per_token("step_time"),
                step_s=statistics.median(s["step_time"] for s in steps),
                rollout_s=statistics.median(s["time/generate"] for s in steps),
                busy_fraction=1 - waiting / generate if generate else 1.0,
                tool_s=TOOL_TIME["s"], not_overlapped=waiting_all / TOOL_TIME["s"] if TOOL_TIME["s"] else 0.0,
                calls_per_trajectory=statistics.median(s["tools/call_frequency"] for s in steps),
                turns_mean=statistics.median(s["tools/turns_mean"] for s in steps),
                model_tokens=statistics.median(s["completions/mean_length"] * batch for s in steps),
                batch_turn_s=statistics.median(seen) if seen else None)


# ---- TRL ------------------------------------------------------------------------------------------


def run_trl(model_dir: str, rows: list[dict], args, out: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_list(rows)
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
                        max_completion_length=args.max_completion_length, max_tool_calling_iterations=6,
                        max_steps=args.steps, use_cpu=True, bf16=False, report_to=[], logging_steps=1, seed=0,
                        save_strategy="no", learning_rate=1e-5, temperature=1.0)
    walls = []

    class StepWall(TrainerCallback):  # (the step's wall time, as our step_time: generation, tools, the update)
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            walls.append(time.perf_counter() - self.start)

    TOOL_TIME.update(s=0.0, calls=0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=answer_reward, args=config, train_dataset=data,
                          environment_factory=Chain, callbacks=[StepWall()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][1:]
    batch = args.prompts * args.n
    tokens = [h["completions/mean_length"] * batch for h in logs]
    return dict(step_s_per_token=statistics.median(w / t for w, t in zip(walls[1:], tokens, strict=True)),
                step_s=statistics.median(walls[1:]), tool_s=TOOL_TIME["s"],
                calls_per_trajectory=statistics.median(h["tools/call_frequency"] for h in logs),
                model_tokens=statistics.median(tokens))


# ---- the parts ------------------------------------------------------------------------------------


def measure(args) -> dict:
    from grpo_fast.generation.engines import make_engine
    from tests.agents.tool_model import build_tool_model

    model_dir = build_tool_model(tempfile.mkdtemp(prefix="bench_agents_"), max_muls=5, conversations=CONVERSATIONS,
                                 steps=TRAIN_STEPS)
    rows = task_rows(args.prompts * args.steps * 2)  # (partial rollouts draw ahead)
    engine = make_engine("vllm", model_path=model_dir, dtype="float32", max_model_len=640, seed=0)
    work = Path(tempfile.mkdtemp(prefix="bench_agents_runs_"))
    deadline = time.monotonic() + 60 * args.timeout_min
    zero = {"per-trajectory": [], "lock-step": []}
    LATENCY["s"] = 0.0
    run_ours(engine, model_dir, rows, args, False, work / "warm")  # (untimed: the engine's first steps are slow)
    for rep in range(args.repeats):  # part 1: interleaved
        for name in zero:
            zero[name].append(run_ours(engine, model_dir, rows, args, name == "lock-step", work / f"zero-{name}-{rep}"))
            print(f"latency 0, {name}, run {rep}: {zero[name][-1]}", flush=True)
        if time.monotonic() > deadline:
            break
    latency = statistics.median(r["batch_turn_s"] for r in zero["lock-step"])
    LATENCY["s"] = latency
    slow = {}
    for name in COLUMNS:  # part 2
        if time.monotonic() > deadline:
            print(f"--timeout_min reached: {name} not run", flush=True)
            break
        slow[name] = (run_trl(model_dir, rows, args, work / "trl") if name == "TRL" else
                      run_ours(engine, model_dir, rows, args, name == "lock-step", work / f"slow-{name}",
                               partial="partial" in name))
        print(f"latency {latency:.3f}, {name}: {slow[name]}", flush=True)
    engine.close()
    return dict(latency_s=latency, zero=zero, slow=slow,
                calls_distribution={k: sum(r["calls"] == k for r in rows) for k in range(2, 7)})


def markdown(report: dict) -> str:
    r, lines = report["results"], []
    med = {name: statistics.median(x["rollout_s_per_token"] for x in runs) for name, runs in r["zero"].items()}
    lines += ["# Agents: per-trajectory turns against lock-step and TRL (CPU)", "", f"Command: `{report['command']}`", "",
              f"{report['setup']}. Machine: {report['machine']}.", "",
              "Tool calls per row (the environment's chain, geometric): " + ", ".join(
                  f"{k}: {v}" for k, v in r["calls_distribution"].items()) + ".", "",
              "## Zero tool latency (interleaved runs)", "",
              "| loop | rollout ms per trained token (runs) | median | vs lock-step |", "| --- | --- | --- | --- |"]
    for name, runs in r["zero"].items():
        each = ", ".join(f"{x['rollout_s_per_token'] * 1e3:.3f}" for x in runs)
        lines.append(f"| {name} | {each} | "
                     f"{med[name] * 1e3:.3f} | {med[name] / med['lock-step']:.2f}x |")
    lines += ["", f"## Tool latency {r['latency_s'] * 1e3:.0f} ms (the median lock-step batch turn above)", "",
              "| column | rollout ms / token | step ms / token | step s | busy fraction | tool s | not overlapped | "
              "calls / trajectory | model tokens / step |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, x in r["slow"].items():
        rollout = f"{x['rollout_s_per_token'] * 1e3:.3f}" if "rollout_s_per_token" in x else "-"
        busy = f"{x['busy_fraction']:.2f}" if "busy_fraction" in x else "-"
        overlap = f"{x['not_overlapped']:.1%}" if "not_overlapped" in x else "-"
        lines.append(f"| {name} | {rollout} | {x['step_s_per_token'] * 1e3:.3f} | {x['step_s']:.2f} | {busy} | "
                     f"{x['tool_s']:.1f} | {overlap} | {x['calls_per_trajectory']:.2f} | {x['model_tokens']:.0f} |")
    s, lines = r["slow"], lines + [""]
    for name in ("per-trajectory", "per-trajectory, partial rollouts"):
        if name in s and "lock-step" in s:
            lines.append(f"Rollout part, {name} / lock-step: "
                         f"{s[name]['rollout_s_per_token'] / s['lock-step']['rollout_s_per_token']:.2f}x (target <= 0.7x); "
                         f"tool time not overlapped: {s[name]['not_overlapped']:.1%} (target <= 10%).")
        if name in s and "TRL" in s:
            lines.append(f"Whole step per trained token, {name} / TRL: "
                         f"{s[name]['step_s_per_token'] / s['TRL']['step_s_per_token']:.2f}x (target <= 0.25x).")
    lines.append(f"Zero latency, per-trajectory / lock-step (rollout part): "
                 f"{med['per-trajectory'] / med['lock-step']:.2f}x (target <= 1.05x).")
    if "lock-step" in s:  # a GPU decodes the same turns ~10x faster while a tool takes as long
        busy = s["lock-step"]["busy_fraction"]
        gpu = busy / 10 / (busy / 10 + 1 - busy)
        lines += ["", f"On a GPU, where decode dominates (a batch turn ~10x faster, the tools as slow): lock-step keeps "
                      f"the busy fraction's decoding part and all its waits, so {busy:.2f} here becomes "
                      f"{busy:.2f}/10 / ({busy:.2f}/10 + {1 - busy:.2f}) = {gpu:.2f}: the engine idles "
                      f"{1 - gpu:.0%} of the rollout. Per-trajectory turns alone do not change that when a batch's "
                      f"trajectories start together and take turns of like length (their tools overlap one another, "
                      f"not decoding); partial rollouts do: new prompts' turns decode while the batch waits, so the busy "
                      f"fraction stays near the {s.get('per-trajectory, partial rollouts', {}).get('busy_fraction', float('nan')):.2f} "
                      f"measured here as long as max_staleness x prompts_per_generation groups hold enough turns to "
                      f"cover a tool's latency (with a batch turn 10x shorter, about 10x the trajectories in flight)."]
    lines += ["", "Rollout part: `time/generate` (generation and tool waits, scoring excluded). Busy fraction: the "
                  "rollout part's share not spent waiting with nothing to decode (`tools/time_waiting`). Not overlapped: "
                  "that wait over the tool calls' summed time. TRL logs no rollout time of its own; its whole step is "
                  "the trainer's step wall time."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="trajectories per prompt (num_generations)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is not counted)")
    parser.add_argument("--max_completion_length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved zero-latency runs per loop")
    parser.add_argument("--timeout_min", type=float, default=60, help="stop starting runs after this many minutes")
    args = parser.parse_args()
    env = harness.environment()
    results = measure(args)
    report = dict(command=harness.command_line(__file__), machine=harness.describe(env), environment=env,
                  results=results,
                  setup=(f"the tiny tool-calling model (tests/agents/tool_model.py), {args.prompts} prompts x {args.n} "
                         f"trajectories per step, up to {args.max_completion_length} completion tokens, {args.steps} steps "
                         f"per run (the first not counted), vLLM float32 for grpo_fast, TRL {harness.package_version('trl')}"))
    harness.write_results(RESULTS / "agents_cpu", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

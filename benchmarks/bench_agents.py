"""What the streaming agent loop buys: multi-turn trajectories on the vLLM engine with tools that take time,
the engine never waiting for a tool (grpo_fast's loop) against lock-step turns (every live trajectory's turn,
then all their tools, concurrently, then the next turn: how the HF engine runs, and TRL 1.16's loop but that
TRL runs a turn's tools one after another).

    python benchmarks/bench_agents.py          # writes benchmarks/results/agents_cpu.{json,md}

The tiny model made to call tools (tests/agents/tool_model.py: add, then mul, then the answer; built in a few
seconds), float32 vLLM on this CPU, `--prompts` x `--n` trajectories of up to 200 tokens per run, temperature 1,
the same seeds for both loops. Tool latency per call: `const` L seconds, or `tail` (L, and 8 L for one call in 8,
picked by the call's arguments). Reported per run: wall seconds, model tokens sampled, tool calls, the
seconds the loop waited with nothing to decode (`tools/time_waiting`), tokens per second; medians of
`--repeats` runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
LOOPS = ("streaming", "lockstep")


def slow_tools(latency: float, tail: bool):
    """The script's add and mul, each call sleeping its latency first (functools.wraps keeps the schema)."""
    from tests.agents import tool_model

    def slow(tool):
        @functools.wraps(tool)
        def call(a: int, b: int) -> str:
            time.sleep(latency * (8 if tail and (int(a) * 31 + int(b)) % 8 == 0 else 1))
            return tool(a, b)

        return call

    return [slow(tool_model.add), slow(tool_model.mul)]


def measure(args) -> list[dict]:
    from transformers import AutoTokenizer

    from grpo_fast.agents import build_agent
    from grpo_fast.agents.loop import AgentLoop, LoopOptions, Trajectory
    from grpo_fast.config import GRPOConfig
    from grpo_fast.rollout import make_engine
    from grpo_fast.rollout.base import SamplingOptions, hashed_seed
    from tests.agents.tool_model import build_tool_model, tool_prompts

    model_dir = build_tool_model(tempfile.mkdtemp(prefix="bench_agents_"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = make_engine("vllm", model_path=model_dir, dtype="float32", max_model_len=512, seed=0)
    config = GRPOConfig(tools=["tests.agents.tool_model:add"], tool_timeout=120)
    rows = tool_prompts(args.prompts, seed=11)
    warm = build_agent(slow_tools(0.0, False), tokenizer, config)  # (one untimed run: the engine's first steps are slow)
    AgentLoop(engine, tokenizer, warm.chat, warm.runner, LoopOptions(200, None, 256, SamplingOptions())).run(
        [Trajectory(prompt_ids=warm.chat.render(r["prompt"], generation_prompt=True), seed=i) for i, r in enumerate(rows)])
    out = []
    for latency in args.latencies:
        for tail in (False, True):
            agent = build_agent(slow_tools(latency, tail), tokenizer, config)
            prompts = [agent.chat.render(r["prompt"], generation_prompt=True) for r in rows]
            for loop_name in LOOPS:
                runs = []
                for rep in range(args.repeats):
                    loop = AgentLoop(engine, tokenizer, agent.chat, agent.runner, LoopOptions(
                        max_completion_length=200, max_tool_calling_iterations=None, max_tool_response_tokens=256,
                        sampling=SamplingOptions(temperature=1.0)))
                    trajectories = [Trajectory(prompt_ids=list(p), seed=hashed_seed(rep, i, j))
                                    for i, p in enumerate(prompts) for j in range(args.n)]
                    start = time.perf_counter()
                    loop.run(trajectories, lockstep=loop_name == "lockstep")
                    wall = time.perf_counter() - start
                    tokens = sum(sum(t.mask) for t in trajectories)
                    runs.append(dict(wall_s=wall, tokens=tokens, calls=sum(t.calls for t in trajectories),
                                     turns=sum(t.turns for t in trajectories), waiting_s=loop.waiting_seconds,
                                     tokens_per_s=tokens / wall))
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                out.append(dict(latency_s=latency, tail=tail, loop=loop_name, runs=runs, median=med))
                print(f"latency {latency} {'tail' if tail else 'const'} {loop_name}: {med}", flush=True)
    engine.close()
    return out


def markdown(report: dict) -> str:
    lines = ["# Agents: the streaming loop against lock-step turns (vLLM engine, CPU)", "",
             f"Command: `{report['command']}`", "", f"{report['setup']}. Machine: {report['machine']}.", "",
             "| tool latency | loop | wall s | model tokens | tool calls | turns | waited s | tokens/s | speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_key = {(r["latency_s"], r["tail"], r["loop"]): r["median"] for r in report["results"]}
    for r in report["results"]:
        m = r["median"]
        lock = by_key[(r["latency_s"], r["tail"], "lockstep")]
        speed = lock["wall_s"] / m["wall_s"]
        label = f"{r['latency_s']:g} s" + (" (1 in 8: 8x)" if r["tail"] else "")
        lines.append(f"| {label} | {r['loop']} | {m['wall_s']:.2f} | {m['tokens']:.0f} | {m['calls']:.0f} | "
                     f"{m['turns']:.0f} | {m['waiting_s']:.2f} | {m['tokens_per_s']:.0f} | {speed:.2f}x |")
    lines += ["", "Speed-up: lock-step's wall time over this loop's. Waited: seconds the loop had nothing to decode "
                  "(every live trajectory waiting on a tool). Both loops sample the same trajectories' seeds; the "
                  "tokens differ a little where a turn's batch differs (vLLM's batch composition)."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.25, 1.0], help="seconds per tool call")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    env = harness.environment()
    results = measure(args)
    report = dict(command=harness.command_line(__file__), machine=harness.describe(env), environment=env,
                  results=results,
                  setup=(f"the tiny tool-calling model (tests/agents/tool_model.py), vLLM float32, {args.prompts} prompts "
                         f"x {args.n} trajectories of up to 200 tokens, temperature 1, {args.repeats} runs per row "
                         f"(medians)"))
    harness.write_results(RESULTS / "agents_cpu", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

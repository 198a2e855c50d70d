"""Where the train part of a default-run step goes on this CPU (torch.profiler), and whether bf16 would help.

    python benchmarks/profile_train.py            # ~3 min on 2 CPU cores

The default run (`grpo-fast train`'s configuration: SmolLM2-135M-Instruct, its prompts, group size and
lengths) for 2 steps; the optimizer step of the second (the train part: forward, fused loss,
backward, optimizer) runs under torch.profiler. Self CPU time per op, grouped: matmuls, attention,
the fused loss, the optimizer, casts and copies, the rest. Then the matmul rate of the step's largest
shape (2048 x 576 x 1536) in float32, bf16 and bf16 autocast, and the CPU's bf16 features
(`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`): the bf16 CPU default of the
long-response issue is decided from these, not from the vendor.

Writes benchmarks/results/profile_train_cpu.{md,json}.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

OUT = ROOT / "benchmarks" / "results" / "profile_train_cpu"
GROUPS = [  # (group, substrings of op names), first match wins
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int", "mkldnn_linear", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("fused loss (grpo_fast ops)", ("grpo_fast",)),
    ("optimizer", ("adam", "_foreach", "clip_grad", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt")),
    ("casts and copies", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat")),
]


def group_of(name: str) -> str:
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def profile_step(overrides: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer

    out = tempfile.mkdtemp(prefix="profile_train_")
    c = GRPOConfig(max_steps=2, eval_before_train=False, eval_steps=0, save_final=False, disable_tqdm=True,
                   output_dir=os.path.join(out, "run"), **overrides)
    trainer = GRPOTrainer.from_config(c)
    step, captured = trainer._optimizer_step, {}

    def profiled(part, num_items, bar):  # the second step's train part, under the profiler
        if trainer.state.step != 1:
            return step(part, num_items, bar)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            metrics = step(part, num_items, bar)
        captured.update(wall_s=time.perf_counter() - start, events=prof.key_averages(), tokens=sum(
            len(ids) for ids in part.completion_ids), sequences=len(part.completion_ids))
        return metrics

    trainer._optimizer_step = profiled
    trainer.train()
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in captured["events"] if e.self_cpu_time_total > 0]
    total = sum(t for _, t, _ in ops)
    groups: dict[str, float] = {}
    for name, t, _ in ops:
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + t
    top = sorted(ops, key=lambda o: -o[1])[:15]
    return {"precision": trainer.precision_summary(), "wall_s": captured["wall_s"], "profiled_self_cpu_s": total, "completion_tokens": captured["tokens"],
            "sequences": captured["sequences"], "threads": torch.get_num_threads(),
            "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": n, "self_cpu_s": t, "calls": k} for n, t, k in top]}


def matmul_rates(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> dict:
    """GFLOP/s of one [m, k] x [k, n] matmul: float32, bfloat16, and float32 inputs under bf16 autocast."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)

    def rate(x, y, autocast=False) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x @ y  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                x @ y
        return 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9

    return {"shape": [m, k, n], "float32": rate(a, b), "bfloat16": rate(a.bfloat16(), b.bfloat16()),
            "bf16_autocast": rate(a, b, autocast=True),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}


def markdown(result: dict, command: str, env: dict) -> str:
    p, mm = result["profile"], result["matmul"]
    lines = ["# The train part of a default-run step, profiled (CPU)", "",
             f"`{command}` on {harness.describe(env)}. Second step of the default run ({p['sequences']} completions, "
             f"{p['completion_tokens']} completion tokens): its optimizer step (forward, fused loss, backward, optimizer) "
             f"took {p['wall_s']:.1f} s wall, {p['profiled_self_cpu_s']:.1f} s of op self time under torch.profiler. "
             f"{p.get('precision', '')[:1].upper()}{p.get('precision', '')[1:]}.", "",
             "| group | self CPU (s) | share |", "| --- | --- | --- |"]
    lines += [f"| {g} | {t:.2f} | {t / p['profiled_self_cpu_s']:.0%} |" for g, t in p["groups"].items()]
    lines += ["", "| op | self CPU (s) | calls |", "| --- | --- | --- |"]
    lines += [f"| `{o['op']}` | {o['self_cpu_s']:.2f} | {o['calls']} |" for o in p["top_ops"]]
    lines += ["", f"Matmul {mm['shape'][0]} x {mm['shape'][1]} x {mm['shape'][2]}: float32 {mm['float32']:.0f} GFLOP/s, "
              f"bfloat16 {mm['bfloat16']:.1f}, bf16 autocast {mm['bf16_autocast']:.1f}. CPU bf16 features: "
              f"avx512_bf16 {mm['avx512_bf16']}, AMX {mm['amx']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed_precision", default="auto", choices=["auto", "no", "bf16"],
                        help="the run's mixed_precision (auto: the default of this CPU)")
    parser.add_argument("--name", default=OUT.name, help="result files benchmarks/results/NAME.{md,json}")
    args = parser.parse_args()
    result = {"profile": profile_step({"mixed_precision": args.mixed_precision}), "matmul": matmul_rates()}
    command, env = harness.command_line(__file__), harness.environment()
    text = markdown(result, command, env)
    harness.write_results(OUT.with_name(args.name), {"command": command, "environment": env, **result}, text)
    print(text)


if __name__ == "__main__":
    main()

"""Why `lora_sync=auto` is `merged`: what each LoRA sync route costs the vLLM engine, decoding and syncing.

    python benchmarks/bench_lora_decode.py      # writes benchmarks/results/lora_cpu_decode.{json,md}

SmolLM2-135M-Instruct (the default model) with an r=16 all-linear adapter away from zero, two in-process
engines in the engine dtype the trainer picks here (bf16 on a CPU with bf16 matmuls): `merged` (the adapted
layers rewritten as W_base + s B A, plain decode) and `adapter` (vLLM's LoRA layers, the adapter loaded
from tensors). Each call samples `--prompts` x `--n` completions of up to `--max-new-tokens` tokens
(the routes sample different tokens in bf16: tokens/s is what compares), then syncs the next adapter version the way the
trainer does; calls alternate between the engines, `--repeats` each, after one warm-up; medians reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ROUTES = ("merged", "adapter")


def measure(args) -> dict:
    import torch
    from peft import LoraConfig

    from grpo_fast.generation.engines import make_engine
    from grpo_fast.generation.engines.build import initial_sync
    from grpo_fast.models import load_policy, lora, resolve_model_path
    from grpo_fast.models.precision import Precision

    path = resolve_model_path("default")
    model, tokenizer = load_policy(path)
    dtype = str(Precision.from_config(setup_config()).engine_dtype(cuda=False)).replace("torch.", "")
    adapted = lora.apply_lora(model, None, peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                                  init_lora_weights=False))
    with torch.no_grad():  # away from zero, small: a trained adapter's size of change
        for name, p in adapted.named_parameters():
            if ".lora_" in name:
                p.mul_(0.1)
    prompts = [tokenizer(f"What is {i} + {2 * i}? Put the final answer in \\boxed{{}}.")["input_ids"]
               for i in range(args.prompts)]
    engines = {}
    for route in ROUTES:
        engine = make_engine("vllm", model_path=path, dtype=dtype, max_model_len=512, seed=0,
                             **({"lora": lora.spec(adapted)} if route == "adapter" else {}))
        initial_sync(engine, adapted, route)
        engine.generate(prompts, n=2, max_new_tokens=8, seed=0)  # warm-up
        engines[route] = engine
    runs = {route: [] for route in ROUTES}
    for rep in range(args.repeats):
        for route, engine in engines.items():
            start = time.perf_counter()
            groups = engine.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens, seed=rep)
            decode = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for g in groups for c in g)
            start = time.perf_counter()
            if route == "merged":
                engine.update_weights(lora.engine_weights(adapted, merged=True, only_adapted=True), partial=True)
            else:
                engine.update_adapter(rep + 1, lora.adapter_tensors(adapted))
            runs[route].append({"tokens": tokens, "decode_s": decode, "tokens_per_s": tokens / decode,
                                "sync_s": time.perf_counter() - start})
    for engine in engines.values():
        engine.close()
    summary = {route: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "decode_s", "sync_s", "tokens")}
               for route, rs in runs.items()}
    return {"engine_dtype": dtype, "runs": runs, "median": summary}


def setup_config():
    from grpo_fast.config import GRPOConfig

    return GRPOConfig()


def markdown(report: dict) -> str:
    m = report["median"]
    lines = ["# LoRA sync routes: decode and sync on the vLLM engine", "", f"Command: `{report['command']}`", "",
             f"{report['setup']}. Machine: {report['machine']}.", "",
             "| route | tokens per call | decode s | tokens/s | sync s |", "| --- | --- | --- | --- | --- |"]
    for route in ROUTES:
        r = m[route]
        lines.append(f"| {route} | {r['tokens']:.0f} | {r['decode_s']:.2f} | {r['tokens_per_s']:.1f} | {r['sync_s']:.3f} |")
    speed = m["merged"]["tokens_per_s"] / m["adapter"]["tokens_per_s"]
    saved = m["adapter"]["decode_s"] - m["merged"]["decode_s"]
    extra = m["merged"]["sync_s"] - m["adapter"]["sync_s"]
    lines += ["", f"merged decodes {speed:.2f}x as fast as the adapter route; per call it saves {saved:.2f} s of decode "
              f"and pays {extra:.3f} s more of sync: `lora_sync=auto` picks merged (docs/design.md, 'LoRA adapters')."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = harness.environment()
    report = measure(args)
    report.update(command=harness.command_line(__file__), machine=harness.describe(env), environment=env,
                  setup=(f"SmolLM2-135M-Instruct, LoRA r 16 alpha 32 all-linear, {args.prompts} prompts x {args.n} "
                         f"completions of {args.max_new_tokens} tokens per call, engine {report['engine_dtype']}, "
                         f"{args.repeats} calls per route, alternating, medians"))
    harness.write_results(RESULTS / "lora_cpu_decode", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

"""Rollout engines on the default model: weight hot-swap against a fresh engine, and generation speed.

    python benchmarks/bench_engine.py                  # writes benchmarks/results/engine_cpu.{json,md}
    python benchmarks/bench_engine.py --prompts 8 --n 4 --max-new-tokens 64 --repeats 5 --gen-repeats 3

Measures, in one process (the trainer's situation: vLLM in-process beside the policy):
  threads   torch.get_num_threads() and a 1024^3 fp32 matmul before the engine starts, after it
            starts, and after it generated: the trainer must keep its cores (VLLM_CPU_OMP_THREADS_BIND)
  swap      VLLMEngine.update_weights(policy) (in place, no disk) against what a fresh engine costs:
            save the policy as a checkpoint + build a new engine from it (after closing the first;
            the first start also pays imports and is reported separately). On the CPU also vLLM's
            generic layerwise reload (the engine's fallback, and its path before the in-place
            re-pack). Also checks the swap: engine log-probs against the policy's
            (fused_linear_logprobs) after perturbing it.
  generate  tokens/s of VLLMEngine and HFEngine on the same chat prompts, n samples each,
            temperature 1, after a warm-up call; generated tokens / wall time. On the CPU also the
            engine with its linear layers on plain F.linear (no oneDNN packing, so an update would
            be the copy alone) against the packed GEMM it uses, and the per-step total of each
            (one update + --step-tokens generated tokens).
Times are medians of --repeats (updates), --gen-repeats, --fresh-repeats. The CPU is shared with other
jobs: load averages are recorded.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # imports no torch: OMP_WAIT_POLICY below still comes first

# Before torch loads OpenMP. On a shared CPU, OpenMP threads that spin at barriers lose their
# timeslices to other jobs' threads: with 2 threads at load ~6, update_weights took 1.9 s instead of
# 0.46 s and vLLM generated 8.5 tokens/s instead of 27. An explicit setting wins (it is recorded).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout works too

QUESTIONS = [f"What is {a} + {b}? Put the final answer in \\boxed{{}}." for a, b in
             [(12, 7), (35, 48), (101, 9), (6, 77), (250, 250), (19, 23), (44, 56), (8, 91)]]


def matmul_ms(size: int = 1024, repeats: int = 10) -> float:
    import torch

    a = torch.randn(size, size)
    return harness.timeit(lambda: torch.mm(a, a), warmup=1, repeats=repeats).mean_s * 1e3


def threads_snapshot(label: str) -> dict:
    import torch

    snap = dict(when=label, torch_threads=torch.get_num_threads(), matmul_1024_ms=round(matmul_ms(), 2),
                affinity=sorted(os.sched_getaffinity(0)))
    print(f"[threads] {snap}", flush=True)
    return snap


def perturb_(model, scale: float, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.detach().abs().mean() * torch.randn(p.shape, generator=gen))


def swap_error(engine, policy, prompts, temperature: float = 1.0) -> float:
    """Mean |engine sampling log-prob - policy log-prob| over generated tokens (fp32 engine: ~1e-6)."""
    import torch

    from grpo_fast import fused_linear_logprobs

    groups = engine.generate(prompts[:2], n=2, max_new_tokens=16, temperature=temperature, seed=0)
    diffs = []
    for prompt, group in zip(prompts, groups, strict=False):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                hidden = policy.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
                ref = fused_linear_logprobs(hidden.contiguous(), policy.lm_head.weight, torch.tensor(c.token_ids),
                                            temperature=temperature)
            diffs.append((torch.tensor(c.logprobs) - ref).abs())
    return torch.cat(diffs).mean().item()


def generation_speed(engine, prompts, args) -> dict:
    engine.generate(prompts[:1], n=1, max_new_tokens=8, seed=0)  # warm-up
    timing = harness.timeit(lambda: engine.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                                                    temperature=1.0, seed=1), repeats=args.gen_repeats)
    seconds, tokens = timing.median_s, sum(len(c.token_ids) for g in timing.result for c in g)
    return dict(seconds=round(seconds, 3), generated_tokens=tokens, tokens_per_s=round(tokens / seconds, 1))


def use_plain_gemm_(engine) -> None:
    """Make the engine's CPU-packed layers compute with F.linear on their checkpoint-format weights
    (no oneDNN packing); the next update_weights re-packs them."""
    import torch

    for (layer, name), tensor in engine._repack_targets.items():
        setattr(layer, name, tensor)
    for layer in engine.model.modules():
        if hasattr(layer, "cpu_linear"):
            layer.cpu_linear = torch.nn.functional.linear


def update_seconds(engine, policy, repeats: int, layerwise: bool = False) -> tuple[float, int]:
    """(median seconds, minor page faults per call) of update_weights; layerwise: vLLM's generic reload."""
    saved = engine._repack_targets
    engine._repack_targets = None if layerwise else saved
    try:
        engine.update_weights(policy)  # warm-up: the first in-place update touches the kept tensors' pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = harness.timeit(lambda: engine.update_weights(policy), repeats=repeats).median_s
        return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // repeats
    finally:
        engine._repack_targets = saved


def fresh_engine_seconds(policy, tokenizer, prompts, engine_kwargs) -> tuple[float, float, float]:
    """(save checkpoint, build engine, build + first token) seconds of replacing the engine by a new one."""
    from grpo_fast.generation.engines import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        fresh = VLLMEngine(tmp, **engine_kwargs)
        build_s = time.perf_counter() - start
        fresh.generate(prompts[:1], n=1, max_new_tokens=1)  # ready to serve
        ready_s = time.perf_counter() - start
        fresh.close()
    return save_s, build_s, ready_s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local folder")
    parser.add_argument("--dtype", default="float32", help="engine and policy dtype")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="update_weights timings")
    parser.add_argument("--gen-repeats", type=int, default=1, help="generation timings per engine")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--fresh-repeats", type=int, default=3, help="fresh-engine timings")
    parser.add_argument("--step-tokens", type=int, default=8192, help="tokens one training step generates (per-step totals)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for engine_cpu.{json,md} (engine_cpu_<dtype>.* for another --dtype)")
    args = parser.parse_args()

    import torch

    from grpo_fast.generation.engines import HFEngine, VLLMEngine
    from grpo_fast.models import load_policy, resolve_model_path

    env = harness.environment()  # load average before
    threads = [threads_snapshot("before engine start")]
    path = resolve_model_path(args.model)
    policy, tokenizer = load_policy(path, dtype=args.dtype)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in (QUESTIONS * args.prompts)[: args.prompts]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine_kwargs = dict(dtype=args.dtype, max_model_len=args.max_model_len, seed=0)

    start = time.perf_counter()
    engine = VLLMEngine(path, **engine_kwargs)
    first_start_s = time.perf_counter() - start
    threads.append(threads_snapshot("after engine start"))

    # ---- hot swap ----------------------------------------------------------------------------
    perturb_(policy, 0.05, seed=1)
    error_before = swap_error(engine, policy, prompts)
    update_s, faults = update_seconds(engine, policy, args.repeats)
    error_after = swap_error(engine, policy, prompts)
    print(f"[swap] update_weights {update_s:.3f} s; mean |dlogprob| before {error_before:.3g}, after {error_after:.3g}")
    cpu = engine._repack_targets is not None
    layerwise = None
    if cpu:
        layerwise_s, layerwise_faults = update_seconds(engine, policy, args.repeats, layerwise=True)
        layerwise = dict(update_weights_s=round(layerwise_s, 4), page_faults_per_update=layerwise_faults)
        print(f"[swap] layerwise reload {layerwise_s:.3f} s", flush=True)

    # ---- generation ------------------------------------------------------------------------
    engine.update_weights(policy)
    vllm_speed = generation_speed(engine, prompts, args)
    print(f"[generate] vllm {vllm_speed}", flush=True)
    threads.append(threads_snapshot("after vLLM generate"))
    gemm = None
    if cpu:  # the alternative to re-packing: plain F.linear, so an update is the copy alone
        use_plain_gemm_(engine)
        from grpo_fast.generation.engines.vllm_engine import _named_tensors

        load_s = harness.timeit(lambda: engine.model.load_weights(engine._prepare(_named_tensors(policy))),
                                repeats=args.repeats).median_s
        plain_speed = generation_speed(engine, prompts, args)
        print(f"[generate] vllm, plain F.linear {plain_speed}; load alone {load_s:.3f} s", flush=True)
        engine.update_weights(policy)  # re-packs
        gemm = {name: dict(update_s=round(u, 4), tokens_per_s=g["tokens_per_s"],
                           step_s=round(u + args.step_tokens / g["tokens_per_s"], 1))
                for name, u, g in (("packed oneDNN (default)", update_s, vllm_speed), ("plain F.linear", load_s, plain_speed))}
    hf_speed = generation_speed(HFEngine(policy, tokenizer, max_model_len=args.max_model_len), prompts, args)
    print(f"[generate] hf {hf_speed}", flush=True)

    # ---- fresh engine from a saved checkpoint ----------------------------------------------
    engine.close()
    fresh_runs = [fresh_engine_seconds(policy, tokenizer, prompts, engine_kwargs) for _ in range(args.fresh_repeats)]
    save_s, build_s, ready_s = (statistics.median(run[i] for run in fresh_runs) for i in range(3))
    reload_s = save_s + ready_s
    print(f"[swap] fresh engine: save {save_s:.2f} s + build {build_s:.2f} s (+first token: {ready_s:.2f} s)")

    result = dict(
        command=harness.command_line(__file__),
        machine=dict(cpu=env["cpu"], cores=env["cores"], load_average_before=env["load_average"],
                     load_average_after=harness.load_average(),
                     note="times are medians; the load averages say how busy the CPU was"),
        environment=env,
        config=dict(vars(args), model_path=path, omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                    omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"), torch_threads=torch.get_num_threads(),
                    torch=torch.__version__, vllm=__import__("vllm").__version__),
        threads=threads,
        swap=dict(update_weights_s=round(update_s, 4), fresh_engine_s=round(reload_s, 2),
                  fresh_save_checkpoint_s=round(save_s, 2), fresh_build_engine_s=round(build_s, 2),
                  first_engine_start_in_process_s=round(first_start_s, 2),
                  ratio_update_over_fresh=round(update_s / reload_s, 4), page_faults_per_update=faults,
                  layerwise_reload=layerwise,
                  mean_abs_logprob_diff_before_update=error_before, mean_abs_logprob_diff_after_update=error_after),
        generate=dict(vllm=vllm_speed, hf=hf_speed, speedup_vllm_over_hf=round(vllm_speed["tokens_per_s"] / hf_speed["tokens_per_s"], 2),
                      cpu_gemm=gemm),
    )
    write_results(result, Path(args.out), "engine_cpu" if args.dtype == "float32" else f"engine_cpu_{args.dtype}")


def write_results(result: dict, out: Path, stem: str) -> None:
    s, g, c, m = result["swap"], result["generate"], result["config"], result["machine"]
    lines = [
        "# Rollout engines on the CPU (bench_engine.py)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model `{c['model_path']}` ({c['dtype']}), vllm {c['vllm']}, {harness.describe(result['environment'])}; "
        f"load average {m['load_average_before']} before, {m['load_average_after']} after. {m['note']}.",
        "",
        "## Weight hot-swap vs a fresh engine",
        "",
        "| what | seconds |",
        "| --- | --- |",
        f"| `update_weights(policy)` (in place, median of {c['repeats']}) | {s['update_weights_s']} |",
        *([f"| vLLM's layerwise reload (the CPU fallback; the path before the in-place re-pack) | "
           f"{s['layerwise_reload']['update_weights_s']} |"] if s.get("layerwise_reload") else []),
        f"| fresh engine: save checkpoint + build engine + first token (median of {c['fresh_repeats']}) | {s['fresh_engine_s']} "
        f"({s['fresh_save_checkpoint_s']} + {s['fresh_build_engine_s']} + rest) |",
        f"| first engine start in the process (imports included) | {s['first_engine_start_in_process_s']} |",
        f"| **ratio update / fresh** | **{s['ratio_update_over_fresh']}** |",
        "",
        f"Minor page faults per update: {s['page_faults_per_update']}"
        + (f"; layerwise reload {s['layerwise_reload']['page_faults_per_update']}" if s.get("layerwise_reload") else "")
        + f" (4 KiB each). torch threads {c['torch_threads']}, OMP_WAIT_POLICY {c['omp_wait_policy']} (the bench's "
        "default: OpenMP threads spinning at barriers on this shared CPU made the update ~4x and generation ~3x slower).",
        "",
        f"Swap check: mean |engine log-prob − policy log-prob| {s['mean_abs_logprob_diff_before_update']:.3g} "
        f"before the update (policy perturbed), {s['mean_abs_logprob_diff_after_update']:.3g} after.",
        "",
        f"## Generation ({c['prompts']} chat prompts × n={c['n']}, ≤{c['max_new_tokens']} new tokens, temperature 1)",
        "",
        "| engine | generated tokens | seconds | tokens/s |",
        "| --- | --- | --- | --- |",
        *(f"| {k} | {v['generated_tokens']} | {v['seconds']} | {v['tokens_per_s']} |" for k, v in (("VLLMEngine", g["vllm"]), ("HFEngine", g["hf"]))),
        "",
        f"vLLM / HF: **{g['speedup_vllm_over_hf']}×**",
        "",
        *(["## CPU GEMM: packed oneDNN (re-packed per update) vs plain F.linear (update = copy alone)",
           "",
           f"| linear layers | update s | vLLM tokens/s | per step s (update + {c['step_tokens']} tokens) |",
           "| --- | --- | --- | --- |",
           *(f"| {k} | {v['update_s']} | {v['tokens_per_s']} | {v['step_s']} |" for k, v in g["cpu_gemm"].items()),
           ""] if g.get("cpu_gemm") else []),
        f"## Trainer threads (VLLM_CPU_OMP_THREADS_BIND={c['omp_threads_bind']})",
        "",
        "| when | torch threads | 1024³ fp32 matmul ms | affinity |",
        "| --- | --- | --- | --- |",
        *(f"| {t['when']} | {t['torch_threads']} | {t['matmul_1024_ms']} | {t['affinity']} |" for t in result["threads"]),
        "",
    ]
    harness.write_results(out / stem, result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

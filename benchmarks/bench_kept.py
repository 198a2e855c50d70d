"""Kept sets (truncated sampling, issue 50): the fused ops over given kept sets, and `linear_topk`, beside the
full-vocabulary fused ops on the same tokens.

    python benchmarks/bench_kept.py                          # CPU preset (float32), writes results/kept_cpu.*
    python benchmarks/bench_kept.py --device cuda --out DIR  # GPU preset (bf16, Triton; = --preset cuda)
    python benchmarks/bench_kept.py --device cuda --dry_run  # the GPU preset's code on tiny sizes, on the CPU
                                                             # (Triton's interpreter): checks it runs, times nothing
    python benchmarks/bench_kept.py --sizes 512x576x49152 --ks 20 --rounds 1

What is timed, per size N x H x V (N tokens, every one active, each with a kept set of k random distinct ids
that holds its target: random ids are the worst case for the kept route's reuse of weight rows; a
sampler's top-k / top-p sets share their ids far more):
  full loss     fused_linear_grpo_loss (dapo, forward + backward), full vocabulary
  kept loss k   the same with the kept sets of size k
  full logp     fused_linear_logprobs under no_grad (the old-policy / reference pass), full vocabulary
  kept logp k   the same over the kept sets
  topk k        linear_topk(k) with the targets: the pass that reconstructs kept sets from the old policy
Targets (issue 50): kept loss <= 0.2 x full loss at k <= 512; topk <= 1.1 x full logp.

Time: best (and median) over `--rounds` interleaved rounds of `--repeats` calls after a warm-up (the CPU is
shared with other jobs: the best is the least disturbed run). On the CPU also the process's CPU seconds per
call (all its threads), best of the same calls: a descheduled thread inflates the wall clock, not these,
so their ratios are the steadier ones on a loaded machine. Memory: the extra peak of one call over what
was in use before it (VmHWM reset before the call on CPU, torch.cuda.max_memory_allocated on GPU), and the
same minus the gradients every implementation returns (grad_weight V x H, grad_hidden N x H): the
workspace, which for the kept route should be O(N k), never O(N V).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout works too

PRESETS = {
    # SmolLM2-135M's head and Qwen2.5-0.5B's, ~512 tokens (issue 50's sizes)
    "cpu": dict(device="cpu", dtype="float32", backend="cpu", sizes=["512x576x49152", "512x896x151936"], ks=[20, 512],
                repeats=2, rounds=2),
    # Qwen2.5-0.5B and 7B heads, a GPU micro-batch of tokens
    "cuda": dict(device="cuda", dtype="bfloat16", backend="triton", sizes=["16384x896x151936", "16384x3584x151936"],
                 ks=[20, 512], repeats=5, rounds=1),
}
DRY_RUN_SIZES = ["40x32x300"]  # --dry_run: every code path on shapes the interpreter runs in seconds
DRY_RUN_KS = [3, 17]


def parse_size(text: str) -> tuple[int, int, int]:
    n, h, v = (int(x) for x in text.lower().split("x"))
    return n, h, v


def make_inputs(n, h, v, k, dtype, device, seed=0):
    import torch

    from grpo_fast.objective import KeptSets

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * h**-0.5 * 2
    target = torch.randint(0, v, (1, n), generator=g)
    sets = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])  # (n, k) distinct ids a row
    has = (sets == target.view(n, 1)).any(-1)
    sets[~has, 0] = target.view(n)[~has]  # the target in its set
    kept = KeptSets(sets.reshape(-1), torch.arange(n + 1) * k)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(hidden=to(hidden), weight=to(weight).contiguous(), target=target.to(device), kept=kept.to(device),
                advantages=torch.randn(1, generator=g).to(device), mask=torch.ones(1, n, device=device))


def calls(x, backend, k):
    """name -> a call (no arguments) for one size and k; the full-vocabulary ones do not depend on k."""
    import torch

    from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs, linear_topk

    def loss(kept):
        def run():
            h = x["hidden"].detach().requires_grad_(True)
            w = x["weight"].detach().requires_grad_(True)
            value, _ = fused_linear_grpo_loss(h, w, x["target"], x["advantages"], x["mask"], backend=backend, kept=kept)
            value.backward()
            return value
        return run

    def logp(kept):
        def run():
            with torch.no_grad():
                return fused_linear_logprobs(x["hidden"], x["weight"], x["target"], backend=backend, kept=kept)
        return run

    return {"full loss": loss(None), f"kept loss {k}": loss(x["kept"]), "full logp": logp(None),
            f"kept logp {k}": logp(x["kept"]),
            f"topk {k}": lambda: linear_topk(x["hidden"], x["weight"], x["target"], k=k, backend=backend)}


def measure(size, ks, dtype_name, device, backend, repeats, rounds):
    import torch

    dtype = getattr(torch, dtype_name)
    n, h, v = size
    rows = {}
    for k in ks:
        x = make_inputs(n, h, v, k, dtype, device)
        fns = calls(x, backend, k)
        if k != ks[0]:  # the full-vocabulary calls once per size
            fns = {name: fn for name, fn in fns.items() if not name.startswith("full")}
        times = {name: [] for name in fns}
        cpu_times = {name: [] for name in fns}
        for fn in fns.values():  # warm-up (first-call costs: thread pools, the Triton compile)
            fn()
        for r in range(rounds):
            order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]  # rotating: every call sees the same load
            for name in order:
                for _ in range(repeats):
                    cpu_start = time.process_time()
                    times[name].append(harness.time_call(fns[name], device))
                    cpu_times[name].append(time.process_time() - cpu_start)
        grads_bytes = (v * h + n * h) * x["weight"].element_size()
        for name, fn in fns.items():
            harness.release_memory()
            with harness.PeakMemory(device, reset_rss_peak=True) as mem:
                fn()
            workspace = mem.extra_bytes - (grads_bytes if "loss" in name else 0)
            rows[name] = dict(best_s=min(times[name]), median_s=sorted(times[name])[len(times[name]) // 2],
                              best_cpu_s=min(cpu_times[name]), extra_peak_mb=mem.extra_bytes / 2**20,
                              workspace_mb=workspace / 2**20)
        if backend == "cpu":
            rows[f"topk {k}"]["row_pass_extra"] = topk_row_pass_extra(x, k, repeats * rounds) / rows["full logp"]["best_cpu_s"]
        del x
    return rows


def topk_row_pass_extra(x, k, repeats) -> float:
    """CPU seconds the topk pass adds to the forward's row pass over the same slabs (cpu backend): the C++
    row_topk (lse, target logit and top k in one sweep) minus row_stats (the forward's), best of `repeats`.
    The matmul, the same in both, is left out: on a loaded machine its time moves by more than this."""
    import torch

    from grpo_fast.objective import LogitMap
    from grpo_fast.ops import cpu, row_ops

    hidden, weight, target = x["hidden"].reshape(-1, x["hidden"].shape[-1]), x["weight"], x["target"].reshape(-1)
    step, spans = row_ops._plan(hidden.shape[0], weight.shape[0], None, weight.element_size())
    slabs = [(hidden[s:e] @ weight.t(), target[s:e]) for s, e in spans[:2]]  # two chunks, scaled to all below

    def best(fn):
        out = []
        for _ in range(repeats):
            start = time.process_time()
            for logits, t in slabs:
                fn(logits, t)
            out.append(time.process_time() - start)
        return min(out) * len(spans) / len(slabs)

    with torch.no_grad():
        stats = best(lambda logits, t: cpu.ROW_OPS.stats(logits, t, LogitMap()))
        topk = best(lambda logits, t: cpu.row_topk(logits, k, LogitMap(), t))
    return topk - stats


def report(result) -> str:
    lines = [f"# Kept sets and linear_topk beside the full-vocabulary fused ops, {result['device']} ({result['dtype']})",
             "", f"Command: `{result['command']}`", "", f"Machine: {result['machine']}; load average at the start "
             f"{result['load_average']}", "",
             "Every token active with a kept set of k random distinct ids holding its target (the worst case for "
             "the reuse of weight rows). `x full`: the time over the full-vocabulary op of the same kind "
             "(loss: fused_linear_grpo_loss forward + backward; logp and topk: one no-grad pass, against the "
             "full-vocabulary logp); `x full (CPU)`: the same on the process's CPU seconds (steadier under load). "
             "Targets: kept loss <= 0.2x, topk <= 1.1x. Workspace: the extra peak minus "
             "the gradients every loss returns (grad_weight V x H, grad_hidden N x H).", ""]
    for size, rows in result["sizes"].items():
        lines += [f"## N x H x V = {size}", "", "| call | best s | median s | x full | best CPU s | x full (CPU) | "
                  "extra peak MB | workspace MB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, row in rows.items():
            base = rows["full loss" if "loss" in name else "full logp"]
            lines.append(f"| {name} | {row['best_s']:.4f} | {row['median_s']:.4f} | {row['best_s'] / base['best_s']:.3f} | "
                         f"{row['best_cpu_s']:.3f} | {row['best_cpu_s'] / base['best_cpu_s']:.3f} | "
                         f"{row['extra_peak_mb']:.0f} | {row['workspace_mb']:.0f} |")
        extra = {name: row["row_pass_extra"] for name, row in rows.items() if "row_pass_extra" in row}
        if extra:
            lines += ["", "The topk pass's own cost, measured on its row pass alone (the C++ row_topk minus the forward's "
                      "row_stats over the same slabs, CPU seconds, as a fraction of the full logp's): "
                      + ", ".join(f"{name}: +{value:.3f}x" for name, value in extra.items())
                      + " (the rest of the pass is the same matmul)."]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", choices=sorted(PRESETS), help="the preset of that device (same as --preset)")
    parser.add_argument("--sizes", nargs="+", help="N x H x V, e.g. 512x576x49152 (default: the preset's)")
    parser.add_argument("--ks", nargs="+", type=int, help="kept-set sizes (default: the preset's)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--dry_run", action="store_true",
                        help="the preset's code on tiny sizes on the CPU (Triton through its interpreter); no results")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.preset = args.device or args.preset
    preset = dict(PRESETS[args.preset])
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before grpo_fast's kernels are imported
        preset.update(device="cpu", sizes=DRY_RUN_SIZES, ks=DRY_RUN_KS, repeats=1, rounds=1)
    sizes = args.sizes or preset["sizes"]
    ks = args.ks or preset["ks"]
    repeats, rounds = args.repeats or preset["repeats"], args.rounds or preset["rounds"]
    env = harness.environment()
    result = dict(command=harness.command_line(__file__), machine=harness.describe(env), environment=env,
                  load_average=env["load_average"], device=preset["device"], dtype=preset["dtype"],
                  backend=preset["backend"], sizes={})
    for text in sizes:
        print(f"[bench_kept] {text} k={ks} ...", flush=True)
        result["sizes"][text] = measure(parse_size(text), ks, preset["dtype"], preset["device"], preset["backend"],
                                        repeats, rounds)
        print(report(result), flush=True)
        if not args.dry_run:
            harness.write_results(args.out / f"kept_{args.preset}", result, report(result))


if __name__ == "__main__":
    main()

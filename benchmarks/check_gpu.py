"""GPU check of the Triton `linear_logprobs` kernels: correctness at full size, speed against the
matmul floor, and (with --sweep) the launch configurations worth trying.

    python benchmarks/check_gpu.py --out DIR [--sweep] [--sizes 896,3584] [--tokens 16384]

Writes DIR/check_gpu.json and DIR/check_gpu.md, and prints the same. The floor is what no fused
implementation can beat: the three unavoidable matmuls (logits, grad_hidden, grad_weight) run by
cuBLAS in bf16; the fused op computes log-probs, entropy and all three gradients. Target: fused
within 1.25x of the floor at N=16k, V=151936.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import harness
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a plain checkout, not installed
from grpo_fast.objective import LogitMap  # noqa: E402  (light: no Triton, no kernels)

VOCAB = 151936  # Qwen2.5


def bench_ms(fn, rep_ms=300):
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench: warm-up, L2 flush)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def matmul_peak_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def make(n, hd, vocab, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hd, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(vocab, hd, device="cuda", generator=gen) * hd**-0.5 * 2).bfloat16()
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen) / n
    return h, w, target, g


def check_values(K, h, w, target, g, rows=512):
    """Max error of fused logp / entropy / grad_hidden on the first rows against fp32 math."""
    logp, entropy, gh, gw, _ = K.fused(h, w, None, target, LogitMap(), lambda s, e, lp: g[s:e])
    z = h[:rows].float() @ w.float().t()
    lsm = torch.log_softmax(z, -1)
    exp_logp = lsm.gather(-1, target[:rows, None]).squeeze(-1)
    exp_entropy = -(lsm.exp() * lsm).sum(-1)
    dz = g[:rows, None] * (torch.nn.functional.one_hot(target[:rows], w.shape[0]).float() - lsm.exp())
    exp_gh = dz @ w.float()
    scale = exp_gh.abs().max().item()
    return {
        "logp_max_err": (logp[:rows] - exp_logp).abs().max().item(),
        "entropy_max_err": (entropy[:rows] - exp_entropy).abs().max().item(),
        "grad_hidden_max_rel_err": ((gh[:rows].float() - exp_gh).abs().max().item() / scale),
        "finite": bool(torch.isfinite(logp).all() and torch.isfinite(gw.float()).all()),
    }


def matmul_floor(h, w):
    """Milliseconds of the three matmuls any implementation needs, cuBLAS, bf16 [N, V] logits."""
    logits = h @ w.t()
    return {
        "logits": bench_ms(lambda: h @ w.t()),
        "grad_hidden": bench_ms(lambda: logits @ w),
        "grad_weight": bench_ms(lambda: logits.t() @ h),
    }


def measure(K, n, hd, vocab, peak):
    h, w, target, g = make(n, hd, vocab)
    flop = 2 * n * vocab * hd  # one [N, H] x [H, V] matmul
    floor = matmul_floor(h, w)
    torch.cuda.empty_cache()
    floor_ms = sum(floor.values())
    _, _, lse = K.forward(h, w, None, target, LogitMap())
    fwd = bench_ms(lambda: K.forward(h, w, None, target, LogitMap()))
    bwd = bench_ms(lambda: K.backward(h, w, None, target, lse, g, LogitMap()))
    with harness.PeakMemory("cuda") as memory:
        fused = bench_ms(lambda: K.fused(h, w, None, target, LogitMap(), lambda s, e, lp: g[s:e]))
    extra_gib = memory.extra_bytes / 2**30
    values = check_values(K, h, w, target, g)
    row = {
        "N": n, "H": hd, "V": vocab,
        "floor_ms": floor_ms, "floor_parts_ms": floor,
        "floor_tflops": 3 * flop / floor_ms / 1e9,
        "forward_ms": fwd, "forward_tflops": flop / fwd / 1e9,
        "backward_ms": bwd, "backward_tflops": 3 * flop / bwd / 1e9,
        "fused_ms": fused, "fused_tflops": 3 * flop / fused / 1e9,
        "fused_over_floor": fused / floor_ms,
        "fused_fraction_of_peak": 3 * flop / fused / 1e9 / peak,
        "fused_extra_peak_gib": extra_gib,
        **values,
    }
    return row  # the inputs die here; the caller empties the cache


SWEEP = [  # LaunchConfig(block_n, block_v, block_k, num_warps, num_stages, maxnreg, tma_store); defaults: K.GPU_CONFIGS
    # (an earlier sweep, in git history: capping registers at 128 for two programs per SM, 2 stages
    # or 4 warps were all slower)
    (128, 128, 64, 8, 3, None, False),
    (128, 128, 64, 8, 3, None, True),  # the fused role's logit tiles stored through a TMA descriptor
    (128, 256, 64, 8, 3, None, False),
    (128, 256, 64, 8, 3, None, True),
    (256, 128, 64, 8, 3, None, True),
]


def sweep(K, n, hd, vocab):
    """Per launch configuration (all kernel roles set to it): the forward, the fused path's forward
    (storing its logit tiles) and in-place gradient kernels, the fused path in all, and the
    recomputing backward kernel on a 4096-row chunk; milliseconds, bf16."""
    h, w, target, g = make(n, hd, vocab)
    _, _, lse = K.forward(h, w, None, target, LogitMap())
    slab = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    default = K.GPU_CONFIGS[torch.bfloat16]
    rows = []
    try:
        for params in SWEEP:
            cfg = K.LaunchConfig(*params)
            K.GPU_CONFIGS[torch.bfloat16] = K.KernelConfigs(forward=cfg, fused=cfg, backward=cfg)
            rows.append({"H": hd, "config": params})
            try:
                rows[-1].update(_time_roles(K, cfg, h, w, target, g, lse, slab))
            except Exception as err:  # out of shared memory / registers: report, keep going
                rows[-1]["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print("sweep", json.dumps(rows[-1]), flush=True)
    finally:
        K.GPU_CONFIGS[torch.bfloat16] = default
    return rows


def _time_roles(K, cfg, h, w, target, g, lse, slab, chunk=4096):
    (n, hd), vocab = h.shape, w.shape[0]
    tile_max = torch.empty(n, -(-vocab // cfg.block_v), device="cuda", dtype=torch.float32)
    row = {
        "forward_ms": bench_ms(lambda: K.forward(h, w, None, target, LogitMap()), rep_ms=200),
        "store_forward_ms": bench_ms(lambda: K._launch_fwd(h, w, None, target, 1.0, slab, tile_max), rep_ms=200),
        "to_grad_ms": bench_ms(lambda: K._launch_logits_to_grad(slab, tile_max, target, lse, g, LogitMap()), rep_ms=200),
        "fused_ms": bench_ms(lambda: K.fused(h, w, None, target, LogitMap(), lambda s, e, lp: g[s:e]), rep_ms=300),
        "bwd_kernel_ms": bench_ms(
            lambda: K._launch_bwd(h[:chunk], w, None, target[:chunk], lse[:chunk], g[:chunk], 1.0, slab[:chunk]),
            rep_ms=200),
    }
    row["forward_tflops"] = 2 * n * vocab * hd / row["forward_ms"] / 1e9
    row["bwd_kernel_tflops"] = 2 * chunk * vocab * hd / row["bwd_kernel_ms"] / 1e9
    return row


def markdown(result):
    lines = [f"# GPU check: {result['device']}", "",
             f"torch {result['torch']}, triton {result['triton']}; bf16 matmul peak (8192^3, cuBLAS): "
             f"**{result['matmul_peak_tflops']:.0f} TFLOP/s**", "",
             "| N | H | floor ms (3 cuBLAS matmuls) | forward ms (TFLOP/s) | backward ms (TFLOP/s) | fused ms (TFLOP/s) "
             "| fused / floor | fused % of peak | fused extra GiB | logp err | entropy err | grad_h rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["sizes"]:
        lines.append(
            f"| {r['N']} | {r['H']} | {r['floor_ms']:.2f} | {r['forward_ms']:.2f} ({r['forward_tflops']:.0f}) "
            f"| {r['backward_ms']:.2f} ({r['backward_tflops']:.0f}) | {r['fused_ms']:.2f} ({r['fused_tflops']:.0f}) "
            f"| **{r['fused_over_floor']:.2f}x** | {100 * r['fused_fraction_of_peak']:.0f}% | {r['fused_extra_peak_gib']:.2f} "
            f"| {r['logp_max_err']:.1e} | {r['entropy_max_err']:.1e} | {r['grad_hidden_max_rel_err']:.1e} |")
    if result.get("sweep"):
        lines += ["", f"## Launch configurations (bf16, N={result['tokens']}; block_n, block_v, block_k, num_warps, "
                  "num_stages, maxnreg, tma_store)", "",
                  "Each kernel role set to the configuration. Fused = the fused path in all (its forward storing the "
                  "logit tiles, the in-place gradient kernel, two cuBLAS matmuls); backward kernel on a 4096-row chunk.",
                  "",
                  "| H | config | forward ms (TFLOP/s) | storing forward ms | gradient kernel ms | fused ms "
                  "| backward kernel ms (TFLOP/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["sweep"]:
            if "error" in r:
                lines.append(f"| {r['H']} | {r['config']} | {r['error']} | | | | |")
            else:
                lines.append(f"| {r['H']} | {r['config']} | {r['forward_ms']:.2f} ({r['forward_tflops']:.0f}) "
                             f"| {r['store_forward_ms']:.2f} | {r['to_grad_ms']:.2f} | {r['fused_ms']:.2f} "
                             f"| {r['bwd_kernel_ms']:.2f} ({r['bwd_kernel_tflops']:.0f}) |")
    lines += ["", "Target: fused / floor <= 1.25 at N=16384, V=151936."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for check_gpu.json and check_gpu.md")
    parser.add_argument("--sizes", default="896,3584", help="hidden sizes H, comma-separated")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens N")
    parser.add_argument("--sweep", action="store_true", help="also time the launch configurations in SWEEP")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_gpu.py needs a CUDA GPU")
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from grpo_fast.kernels import linear_logprobs as K

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    env = harness.environment()
    result = {"device": env["gpu"], "torch": env["torch"], "triton": triton.__version__, "matmul_peak_tflops": peak,
              "sizes": [], "sweep": [], "command": harness.command_line(__file__), "environment": env}
    stem = args.out / "check_gpu"
    for hd in (int(x) for x in args.sizes.split(",")):
        row = measure(K, args.tokens, hd, VOCAB, peak)
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        print(f"H={hd}: fused {row['fused_ms']:.2f} ms = {row['fused_over_floor']:.2f}x the matmul floor "
              f"({row['floor_ms']:.2f} ms), {100 * row['fused_fraction_of_peak']:.0f}% of the measured bf16 matmul peak",
              flush=True)
        result["sizes"].append(row)
        harness.write_results(stem, result, indent=1)  # partial results survive a timeout
    if args.sweep:
        result["tokens"] = args.tokens
        for hd in (int(x) for x in args.sizes.split(",")):
            result["sweep"] += sweep(K, args.tokens, hd, VOCAB)
            torch.cuda.empty_cache()
            harness.write_results(stem, result, indent=1)
    result["seconds"] = time.time() - start
    harness.write_results(stem, result, markdown(result), indent=1)
    print(markdown(result))


if __name__ == "__main__":
    main()

"""GRPO loss, forward + backward: grpo_fast against plain PyTorch, Liger and the matmul floor.

    python benchmarks/bench_loss.py                       # CPU preset (fp32), writes results/loss_cpu.*
    python benchmarks/bench_loss.py --device cuda --out DIR   # GPU preset (bf16, Qwen2.5 heads)
    python benchmarks/bench_loss.py --sizes 4x512x512x32768 --impls plain,cpu --rounds 3
    python benchmarks/bench_loss.py --preset cpu-loss-types     # TRL's loss types beside dapo, results/loss_types_cpu.*
    python benchmarks/bench_loss.py --preset cpu-logit-maps     # Gemma 2's soft-cap beside dapo, results/logit_maps_cpu.*

Implementations, each run in its own subprocess (so peak memory is its own):
  floor    the three unavoidable matmuls of the same shapes (logits, grad_hidden, grad_weight),
           nothing else: no implementation can beat it
  plain    plain PyTorch as TRL's GRPOTrainer does it: materialise logits [B, T, V], log-softmax
           + gather (trl.trainer.utils.selective_log_softmax's CPU path: per-row logsumexp for
           fp32, per-row log_softmax for bf16), entropy under no_grad, then the loss
  liger    liger_kernel's LigerFusedLinearGRPOLoss (compiled=False on CPU)
  torch, cpu, triton   grpo_fast.ops.fused_linear_grpo_loss with that backend
All compute the dapo loss, beta=0, temperature 1, every token active, same seeded inputs.
  BACKEND:VARIANT  grpo_fast with that backend and loss variant (VARIANTS below: dapo, cispo, sapo,
           vespo, luspo, gspo = grpo at sequence level, entropy = dapo with the entropy bonus), all
           off-policy (old log-probs = the true ones + noise, so ratios spread around 1): the
           `*-loss-types` presets time TRL's loss types and the entropy bonus beside dapo.

Time: best and median of `--repeats` runs after `--warmup`, over `--rounds` interleaved rounds
(the CPU is shared with other jobs: the best is the least disturbed run). Memory: extra peak over
the inputs, during the runs: peak RSS (ru_maxrss) minus RSS before the first run on CPU, one
process per (implementation, size); torch.cuda.max_memory_allocated minus the allocated bytes
before on GPU. It includes the gradients themselves (grad_weight V x H, grad_hidden N x H),
which every implementation must return.
First call (CPU): what a user's process sees. A fresh process per (implementation, size) imports
torch, builds the inputs, then imports the implementation and runs one forward + backward with no
warm-up: its peak RSS (VmHWM, reset after the inputs are built) minus the RSS then. It adds to the
memory above whatever the first call loads (libraries, thread pools), and the same for every
implementation; `modules` counts the Python modules the call imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout works too

PRESETS = {
    # B x T x H x V. The first CPU size is issue 3's target; the others are SmolLM2 and a
    # Qwen2.5-0.5B head.
    "cpu": dict(device="cpu", sizes=["4x512x512x32768", "2x512x576x49152", "1x1024x896x151936"], dtype="float32",
                impls=["floor", "plain", "liger", "torch", "cpu"], warmup=1, repeats=3, rounds=2, budget=None),
    # Qwen2.5-0.5B and 7B heads (H 896 / 3584, V 151936), N up to 32k tokens.
    "cuda": dict(device="cuda", sizes=["8x512x896x151936", "16x1024x896x151936", "32x1024x896x151936",
                        "16x1024x3584x151936", "32x1024x3584x151936"], dtype="bfloat16",
                 impls=["floor", "triton", "plain", "liger", "torch"], warmup=2, repeats=5, rounds=1, budget=150),
    # TRL's loss types and the entropy bonus beside dapo (issue 13's targets: cispo, sapo <= 1.05x dapo;
    # vespo, luspo <= the sequence-level (GSPO) path; the entropy bonus <= 1.15x dapo; the same extra peak)
    "cpu-loss-types": dict(device="cpu", sizes=["4x512x512x32768"], dtype="float32",
                           impls=["floor", "cpu:dapo", "cpu:cispo", "cpu:sapo", "cpu:entropy", "cpu:gspo", "cpu:vespo",
                                  "cpu:luspo"], warmup=1, repeats=3, rounds=3, budget=None, refs=["cpu:dapo", "cpu:gspo"]),
    # the model's logit map inside the op: Gemma 2's soft-cap (30) beside dapo without one (issue 48)
    "cpu-logit-maps": dict(device="cpu", sizes=["4x512x512x32768"], dtype="float32",
                           impls=["floor", "cpu:dapo", "cpu:softcap", "torch:dapo", "torch:softcap"], warmup=1,
                           repeats=3, rounds=2, budget=None, refs=["cpu:dapo", "torch:dapo"]),
    "cuda-logit-maps": dict(device="cuda", sizes=["16x1024x896x151936"], dtype="bfloat16",
                            impls=["floor", "triton:dapo", "triton:softcap"], warmup=2, repeats=5, rounds=1, budget=40,
                            refs=["triton:dapo"]),
    "cuda-loss-types": dict(device="cuda", sizes=["16x1024x896x151936"], dtype="bfloat16",
                            impls=["floor", "triton:dapo", "triton:cispo", "triton:sapo", "triton:entropy",
                                   "triton:gspo", "triton:vespo", "triton:luspo"], warmup=2, repeats=5, rounds=1,
                            budget=100, refs=["triton:dapo", "triton:gspo"]),
}
VARIANTS = {  # BACKEND:VARIANT -> the loss options beside the backend
    "dapo": {}, "cispo": dict(loss_type="cispo", epsilon_high=5.0), "sapo": dict(loss_type="sapo"),
    "vespo": dict(loss_type="vespo"), "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"), "entropy": dict(entropy_coef=0.01),
    "softcap": dict(logit_softcap=30.0),  # Gemma 2's final_logit_softcapping, inside the op (objective.LogitMap)
}
GRPO_FAST = ("torch", "cpu", "triton")


def parse_size(text: str):
    B, T, H, V = (int(x) for x in text.lower().split("x"))
    return B, T, H, V


# ------------------------------------------------------------------------------------------------
# Worker: one implementation, runs in its own process
# ------------------------------------------------------------------------------------------------


def make_inputs(size, dtype, device, seed=0):
    import torch

    B, T, H, V = size
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, device=device) * H**-0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, V, (B, T), generator=g, device=device)
    advantages = torch.randn(B, generator=g, device=device)
    mask = torch.ones(B, T, device=device)
    return hidden, weight, target, advantages, mask


def plain_step(hidden, weight, target, advantages, mask):
    """Plain PyTorch, as TRL: full logits, per-row log-softmax + gather, entropy without grad."""
    import torch

    from grpo_fast import objective

    logits = hidden @ weight.t()  # (B, T, V) materialised
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # TRL loops rows to cap the peak
        logp = selected - lse
    else:
        logp = torch.stack([torch.log_softmax(row, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1) for row, t in zip(logits, target, strict=True)])
    with torch.no_grad():  # TRL's entropy_from_logits: chunks of 128 rows
        entropy = []
        for chunk in logits.reshape(-1, logits.shape[-1]).split(128):
            logps = torch.log_softmax(chunk, -1)
            entropy.append(-(logps.exp() * logps).sum(-1))
        entropy = torch.cat(entropy).float()
    loss, _ = objective.grpo_loss_from_logprobs(logp.float(), advantages, mask, objective.LossOptions(loss_type="dapo"),
                                                entropy=entropy.view_as(logp))
    loss.backward()


def make_step(impl, inputs, device):
    """A closure running one forward + backward of `impl` on `inputs`."""
    hidden, weight, target, advantages, mask = inputs
    if impl == "floor":
        h2 = hidden.detach().reshape(-1, hidden.shape[-1])
        w = weight.detach()

        def floor():
            logits = h2 @ w.t()
            logits @ w, logits.t() @ h2

        return floor
    if impl == "plain":
        return lambda: plain_step(hidden, weight, target, advantages, mask)
    if impl == "liger":
        return _liger_step(inputs, compiled=device == "cuda")
    if impl in GRPO_FAST:
        from grpo_fast.ops import fused_linear_grpo_loss

        def fused():
            loss, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, loss_type="dapo", backend=impl)
            loss.backward()

        return fused
    if impl.partition(":")[0] in GRPO_FAST:
        return _variant_step(impl, inputs)
    raise ValueError(f"unknown implementation {impl!r}")


def _variant_step(impl, inputs):
    """grpo_fast's BACKEND:VARIANT, off-policy: old log-probs = the true ones + noise (ratios ~ 1 +- 0.3)."""
    import torch

    from grpo_fast.objective import LossOptions
    from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs

    backend, variant = impl.split(":")
    hidden, weight, target, advantages, mask = inputs
    with torch.no_grad():
        g = torch.Generator(device=hidden.device).manual_seed(1)
        noise = torch.randn(target.shape, generator=g, device=hidden.device)
    options = LossOptions(backend=backend, **VARIANTS[variant])
    with torch.no_grad():
        old = fused_linear_logprobs(hidden, weight, target, backend=backend, logit_scale=options.logit_scale,
                                    logit_softcap=options.logit_softcap) + 0.3 * noise

    def fused():
        loss, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, old_logp=old, options=options)
        loss.backward()

    return fused


NOTES = {}  # impl -> what differs from its intended configuration, reported with the results


def _liger_step(inputs, compiled):
    """Liger's LigerFusedLinearGRPOLoss. On GPU it torch.compiles its per-chunk loss math (its default;
    the log-probs stay in its own chunked autograd function either way). If that compile fails, as
    it did on an H200 with torch 2.11 (a dynamic-shape assertion, "sources must not be empty for
    symbol s37", also with Liger's dynamic marks disabled), the loss math runs eagerly and the
    results say so."""
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    hidden, weight, target, advantages, mask = inputs

    def make(compiled):
        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=compiled, loss_type="dapo", temperature=1.0)

        def liger():
            out = loss_fn(hidden, weight, target, mask, advantages)
            (out[0] if isinstance(out, tuple) else out).backward()

        return liger

    if not compiled or "liger" in NOTES:
        return make(False)
    step = make(True)
    try:
        step()  # compiles now, outside the timed and memory-measured runs
    except Exception as err:  # noqa: BLE001 - any compiler failure: fall back, and report it
        torch._dynamo.reset()
        NOTES["liger"] = f"torch.compile failed ({type(err).__name__}: {str(err).strip()[:120]}); loss math run eagerly"
        step = make(False)
    hidden.grad = weight.grad = None
    return step


def _warm_up(impl, size, dtype, device):
    """One tiny run first: library start-up (thread pools, MKL buffers, autograd threads, Liger's
    imports) is paid once per process and is not what the measurements are about."""
    B, T, H, V = size
    make_step(impl, make_inputs((1, 4, H, min(V, 256)), dtype, device), device)()


def _timed(step, inputs, device) -> float:
    inputs[0].grad = inputs[1].grad = None
    return harness.time_call(step, device)


def first_call_worker(impl, sizes, dtype_name, device):
    """Prints one JSON line per size: the first call of `impl` in this fresh process (see the module
    docstring), its extra peak RSS and the modules it imported. One size per process."""
    import torch

    assert len(sizes) == 1 and device == "cpu", "first-call mode: one CPU size per process"
    text = sizes[0]
    row = dict(impl=impl, size=text, dtype=dtype_name, device=device, mode="first-call", threads=torch.get_num_threads())
    inputs = make_inputs(parse_size(text), getattr(torch, dtype_name), device)
    harness.release_memory()
    modules = len(sys.modules)
    try:
        with harness.PeakMemory(device, reset_rss_peak=True) as memory:
            start = time.perf_counter()
            make_step(impl, inputs, device)()
            row["first_call_s"] = time.perf_counter() - start
    except ImportError as err:
        row["unavailable"] = f"{type(err).__name__}: {err}"
    else:
        row.update(first_call_mb=memory.extra_bytes / 2**20, modules=len(sys.modules) - modules,
                   dynamo="torch._dynamo" in sys.modules)
    print("RESULT " + json.dumps(row), flush=True)


def worker(impls, sizes, dtype_name, device, warmup, repeats, mode):
    """Prints one JSON line per (impl, size).

    mode "memory": one implementation; its extra peak memory, and the times of its runs.
    mode "interleave": time only, every implementation in this one process on the same inputs,
    one run of each per round, the order rotating: on a shared CPU all of them see the same load.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    for text in sizes:
        size = parse_size(text)
        rows, steps = {}, {}
        inputs = None
        for impl in impls:
            rows[impl] = dict(impl=impl, size=text, dtype=dtype_name, device=device, mode=mode, threads=torch.get_num_threads())
            try:
                _warm_up(impl, size, dtype, device)
            except ImportError as err:
                rows[impl]["unavailable"] = f"{type(err).__name__}: {err}"
        live = [i for i in impls if "unavailable" not in rows[i]]
        if live:
            inputs = make_inputs(size, dtype, device)
            steps = {impl: make_step(impl, inputs, device) for impl in live}
            if device == "cuda":
                torch.cuda.empty_cache()
            times = {impl: [] for impl in live}
            with harness.PeakMemory(device) as memory:  # CPU: ru_maxrss, hence one process per measurement
                for r in range(warmup + repeats):
                    for k in range(len(live)):
                        impl = live[(r + k) % len(live)]
                        t = _timed(steps[impl], inputs, device)
                        if r >= warmup:
                            times[impl].append(t)
            for impl in live:
                rows[impl]["times_s"] = times[impl]
                if impl in NOTES:
                    rows[impl]["note"] = NOTES[impl]
            if mode == "memory":
                rows[live[0]]["extra_peak_mb"] = memory.extra_bytes / 2**20
        for impl in impls:
            print("RESULT " + json.dumps(rows[impl]), flush=True)
        del inputs, steps


# ------------------------------------------------------------------------------------------------
# Driver: subprocesses, aggregation, report
# ------------------------------------------------------------------------------------------------


def run_worker(args, impls, sizes, mode, timeout, warmup, repeats):
    cmd = [sys.executable, __file__, "--worker", ",".join(impls), "--mode", mode, "--preset", args.preset,
           "--dtype", args.dtype, "--sizes", ",".join(sizes), "--warmup", str(warmup), "--repeats", str(repeats)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        stdout = proc.stdout
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        why = f"rc={proc.returncode}: {tail[0][:200]}"
    except subprocess.TimeoutExpired as err:  # keep the sizes it finished before the timeout
        stdout, why = _text(err.stdout), f"timed out after {timeout:.0f}s"
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    done = {(r["impl"], r["size"]) for r in rows}
    rows += [dict(impl=i, size=s, mode=mode, failed=why) for i in impls for s in sizes if (i, s) not in done]
    return rows


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def summarise(rows):
    """{size: {impl: summary}}: best/median time over every timed run (the interleaved ones when
    there are any), median extra peak memory over the memory runs."""
    out = {}
    interleaved = any(r.get("mode") == "interleave" and "times_s" in r for r in rows)
    for r in rows:
        cell = out.setdefault(r["size"], {}).setdefault(r["impl"], dict(times=[], mem=[], note=None))
        if "times_s" in r and (r.get("mode") == "interleave" or not interleaved):
            cell["times"] += r["times_s"]
        if "extra_peak_mb" in r:
            cell["mem"].append(r["extra_peak_mb"])
        if r.get("mode") == "first-call":
            if "first_call_mb" in r:
                cell.update(first_call_mb=r["first_call_mb"], first_call_modules=r["modules"])
            elif not cell["note"]:
                cell["note"] = f"first call: {r.get('unavailable') or r.get('failed')}"
        elif "times_s" not in r:
            cell["note"] = r.get("unavailable") or r.get("failed")
        elif r.get("note"):
            cell["note"] = r["note"]
    for impls in out.values():
        for cell in impls.values():
            if cell["times"] and cell["mem"]:
                cell.update(best_s=min(cell["times"]), median_s=statistics.median(cell["times"]),
                            extra_peak_mb=statistics.median(cell["mem"]))
    return out


def flops(size) -> float:
    B, T, H, V = parse_size(size)
    return 6.0 * B * T * H * V  # three [N, H] x [H, V]-sized matmuls, 2 flops per multiply-add


def markdown(summary, args, command, env) -> str:
    lines = [f"# GRPO loss forward + backward, {args.device} ({args.dtype})", "", f"Command: `{command}`", "",
             f"Machine: {harness.describe(env)}", "",
             _method(args), "",
             "Ratios use the best times. Memory: extra peak over the inputs, in a process of its own per "
             "implementation (it includes the gradients every implementation returns). TFLOP/s counts the "
             "3 matmuls (6 N H V); `% floor` = floor time / time, the fraction of the measured matmul rate "
             "achieved.", ""]
    if args.device == "cpu":
        lines += ["First call: a fresh process per implementation imports torch and builds the inputs, then "
                  "imports the implementation and runs one forward + backward with no warm-up; its extra peak "
                  "RSS over the RSS after the inputs (what a user's process sees: the libraries and thread pools "
                  "the first call loads included), and the Python modules that call imported.", ""]
    refs = PRESETS[args.preset].get("refs", [])
    for size, impls in summary.items():
        floor, plain, liger = (impls.get(k, {}).get("best_s") for k in ("floor", "plain", "liger"))
        plain_mem = impls.get("plain", {}).get("extra_peak_mb")
        plain_first = impls.get("plain", {}).get("first_call_mb")
        first = args.device == "cpu"
        ref_cells = [(impls.get(r, {}).get("best_s"), impls.get(r, {}).get("extra_peak_mb")) for r in refs]
        head = ["impl", "best s", "median s", "x plain", "x liger", "x floor", "TFLOP/s", "% floor", "extra peak MB",
                "x plain mem"] + (["first call MB", "x plain first", "modules"] if first else []) + [f"x {r}" for r in refs] + [f"x {r} mem" for r in refs]
        lines += [f"## B x T x H x V = {size.replace('x', ' x ')}", "", "| " + " | ".join(head) + " |",
                  "|" + " --- |" * len(head)]
        for impl, c in impls.items():
            if "best_s" not in c:
                lines.append(f"| {impl} | {c['note']} |" + " |" * (len(head) - 2))
                continue
            t, mem = c["best_s"], c["extra_peak_mb"]
            cells = [impl, f"{t:.3f}", f"{c['median_s']:.3f}", _ratio(t, plain), _ratio(t, liger), _ratio(t, floor),
                     f"{flops(size) / t / 1e12:.3f}", f"{100 * floor / t:.0f}%" if floor else "-", f"{mem:.0f}",
                     _ratio(mem, plain_mem)] + (_first_call_cells(c, plain_first) if first else []) + [_ratio(t, rt) for rt, _ in ref_cells] + [_ratio(mem, rm) for _, rm in ref_cells]
            lines.append("| " + " | ".join(cells) + " |")
        notes = [f"{impl}: {c['note']}" for impl, c in impls.items() if "best_s" in c and c["note"]]
        lines += [""] + notes + ([""] if notes else [])
    return "\n".join(lines)


def _method(args) -> str:
    if args.device == "cpu":
        return (f"Time: best (and median) of {args.repeats * args.rounds} runs per implementation: {args.rounds} "
                f"process(es) per size, each running every implementation on the same inputs in rotating "
                f"order, {args.repeats} rounds after {args.warmup} warm-up. The CPU is shared with other jobs "
                "(other agents were running tests and benchmarks): interleaving exposes all implementations "
                "to the same load, and the best run is the least disturbed one.")
    return f"Time: best (and median) of {args.repeats} runs after {args.warmup} warm-up, one process per implementation."


def _first_call_cells(cell, plain_first) -> list[str]:
    if "first_call_mb" not in cell:
        return ["-", "-", "-"]
    return [f"{cell['first_call_mb']:.0f}", _ratio(cell["first_call_mb"], plain_first), str(cell["first_call_modules"])]


def _ratio(x, ref) -> str:
    return f"{x / ref:.2f}" if ref else "-"


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary)
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.5 * len(sizes), 7), squeeze=False)
    for j, size in enumerate(sizes):
        impls = {k: v for k, v in summary[size].items() if "best_s" in v}
        names = list(impls)
        colors = ["#999999" if n == "floor" else "#d62728" if n == "plain" else "#ff7f0e" if n == "liger" else "#1f77b4" for n in names]
        axes[0][j].bar(names, [impls[n]["best_s"] for n in names], color=colors)
        axes[0][j].set_title(size, fontsize=9)
        axes[0][j].set_ylabel("fwd+bwd time, s (best)")
        axes[1][j].bar(names, [impls[n]["extra_peak_mb"] for n in names], color=colors)
        axes[1][j].set_ylabel("extra peak memory, MB")
        for ax in axes[:, j]:
            ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle("GRPO loss fwd+bwd (grey: matmul floor, red: plain PyTorch, orange: Liger, blue: grpo_fast)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="picks the preset of that name")
    parser.add_argument("--preset", choices=list(PRESETS), help="device, sizes, implementations and repeats "
                        "(default: --device's)")
    parser.add_argument("--sizes", help="comma-separated BxTxHxV (default: the device preset)")
    parser.add_argument("--impls", help=f"comma-separated, from floor,plain,liger,{','.join(GRPO_FAST)} (default: the preset)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--repeats", type=int, help="timed runs of each implementation per round")
    parser.add_argument("--rounds", type=int, help="CPU: timing processes per size (each interleaving all implementations)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    parser.add_argument("--budget", type=float, help="seconds for the whole run; workers that would start "
                        "later are skipped and marked (default: none on cpu, 150 on cuda, to fit gpu_suite.sh)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="memory", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.preset = args.preset or args.device
    preset = PRESETS[args.preset]
    args.device = preset["device"]
    for key in ("dtype", "warmup", "repeats", "rounds", "budget"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    sizes = args.sizes.split(",") if args.sizes else preset["sizes"]
    if args.worker and args.mode == "first-call":
        return first_call_worker(args.worker, sizes, args.dtype, args.device)
    if args.worker:
        return worker(args.worker.split(","), sizes, args.dtype, args.device, args.warmup, args.repeats, args.mode)

    impls = args.impls.split(",") if args.impls else preset["impls"]
    command = harness.command_line(__file__, argv)
    env = harness.environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = next((k for k in ("loss-types", "logit-maps") if args.preset and args.preset.endswith(k)), None)
    name = f"{kind.replace('-', '_')}_{args.device}" if kind else f"loss_{args.device}"
    stem = out / (name + ("" if args.dtype == preset["dtype"] else f"_{args.dtype}"))
    rows = []
    deadline = time.monotonic() + (args.budget or float("inf"))

    def run(impls_, sizes_, mode, warmup, repeats, label):
        left = deadline - time.monotonic()
        if left < 10:
            new = [dict(impl=i, size=s, failed=f"skipped: --budget {args.budget:.0f}s spent") for i in impls_ for s in sizes_]
        else:
            new = run_worker(args, impls_, sizes_, mode, min(args.timeout, left), warmup, repeats)
        rows.extend(new)
        for row in new:
            what = row.get("unavailable") or row.get("failed") or (
                f"first call {row['first_call_s']:.3f} s  extra peak {row['first_call_mb']:.0f} MB  "
                f"{row['modules']} modules" if "first_call_mb" in row else f"best {min(row['times_s']):.3f} s" + (
                    f"  extra peak {row['extra_peak_mb']:.0f} MB" if "extra_peak_mb" in row else ""))
            print(f"{label:12s} {row['impl']:7s} {row['size']:22s} {what}", flush=True)
        summary = summarise(rows)  # rewrite after every worker: a timeout keeps what was measured
        result = dict(command=command, machine=harness.describe(env), environment=env, args=vars(args), summary=summary,
                      runs=rows)
        harness.write_results(stem, result, markdown(summary, args, command, env), indent=1)

    if args.device == "cpu":
        # memory: one process per (impl, size), since peak RSS only grows; time: all implementations
        # interleaved in one process per size, `repeats` rounds
        for size in sizes:
            for impl in impls:
                run([impl], [size], "memory", 0, 1, "memory")
                if impl != "floor":  # the floor is no library a user calls
                    run([impl], [size], "first-call", 0, 0, "first call")
        for r in range(args.rounds):
            for size in sizes:
                run(impls, [size], "interleave", args.warmup, args.repeats, f"time round {r + 1}")
    else:  # GPU: nothing else runs there; one process per implementation measures both
        for impl in impls:
            run([impl], sizes, "memory", args.warmup, args.repeats, "time+memory")
    plot(summarise(rows), stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

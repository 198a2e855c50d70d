"""Communication per optimizer step on many ranks: DDP's gradient all-reduce, FSDP2's all-gathers and
reduce-scatter, and the weight sync into the rollout engine; measured on 2 gloo CPU ranks, then a
written model of the bytes per step at any model size and rank count, at NVLink and InfiniBand rates.

    python benchmarks/bench_distributed.py                 # writes benchmarks/results/distributed_cpu.{json,md}
    python benchmarks/bench_distributed.py --model tiny --steps 2 --output /tmp/dist

Run plainly, it launches itself under `torch.distributed.run --standalone --nproc_per_node 2` (gloo,
OMP_NUM_THREADS=1 per rank); the ranks measure, rank 0 hands its figures back, and the launcher
writes the report. The model is a LlamaForCausalLM with random weights (no download): SmolLM2-135M's
shape by default (falls back to the tiny shape when memory is short), fp32 on the CPU. Each rank
trains on its own micro-batch of `--tokens` tokens, through the trainer's own wrappers and loss
(`grpo_fast.distributed.parallelize`, DDP or FSDP2 over DecoderForward; the fused log-prob
op on the lm_head weight of `policy_parts`).

What is timed (median of `--steps` repeats after one warm-up):
- DDP: one forward+backward under `no_sync()` (compute only), and one that all-reduces. A DDP comm
  hook runs each bucket's all-reduce blocking and times it, so the communication is measured on
  DDP's real buckets (25 MiB), apart from the backward it would otherwise overlap with.
- FSDP2 (`fully_shard` on each decoder layer, then on the root): one micro-batch with gradient sync
  off (its all-gathers only: forward, and again in backward) and one with it on (plus the
  reduce-scatter); custom all-gather / reduce-scatter comms (`set_custom_all_gather`) record every
  collective's bytes and wait for it, timing it.
- Weight sync under FSDP2, two ways, each copied into an engine-side copy of the weights in 64 MiB
  buckets: the trainer's (`Parallel.full_weights`: one all-gather per unit, layer by layer) and one
  `DTensor.full_tensor()` per parameter (what an engine's `update_weights` does when handed the
  sharded module); under DDP the copy only (the weights are whole).
Bytes are per rank: "payload" is the tensor a rank hands in (all-reduce) or gets back whole
(all-gather, reduce-scatter input); "wire" is what each rank sends in a ring algorithm,
2(N-1)/N x payload for an all-reduce, (N-1)/N x payload for an all-gather or reduce-scatter. algbw =
payload / s, busbw = wire / s (the nccl-tests convention, comparable across N).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import harness
from distributed_model import FABRICS, model_section, scaling_notes, scaling_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "distributed_cpu"

DDP_BUCKET_MB = 25  # DDP's default bucket_cap_mb, which data_parallel keeps
SYNC_BUCKET_BYTES = 64 << 20  # weight sync: copy into the engine per 64 MiB of gathered weights

SYNC_WAYS = {"trainer": "the trainer's Parallel.full_weights (one all-gather per unit)",
             "per_parameter": "DTensor.full_tensor() per parameter"}

SHAPES = {  # LlamaConfig fields; random weights, never downloaded
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "tiny": dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
}

# ------------------------------------------------------------------------------------------------
# Byte counts (ring algorithms)
# ------------------------------------------------------------------------------------------------


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes each rank sends for a collective over `payload` bytes (the whole tensor) on n ranks."""
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * payload


def bandwidths(kind: str, payload: float, n: int, seconds: float, best_s: float | None = None) -> dict:
    """Bytes and rates of a collective's median `seconds`; best_s (the least disturbed run) kept beside it."""
    return dict(payload_bytes=payload, wire_bytes=wire_bytes(kind, payload, n), seconds=seconds, best_s=best_s,
                algbw_GBps=payload / seconds / 1e9 if seconds else None,
                busbw_GBps=wire_bytes(kind, payload, n) / seconds / 1e9 if seconds else None)


# ------------------------------------------------------------------------------------------------
# On each rank
# ------------------------------------------------------------------------------------------------


def build_lm(shape: str):
    """A fp32 LlamaForCausalLM of the shape, random weights from seed 0 (the same on every rank)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))


def micro_batch(shape: str, tokens: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data, as in training
    return torch.randint(0, SHAPES[shape]["vocab_size"], (1, tokens + 1), generator=g)


def loss_of(forward, lm, ids):
    """The trainer's path: the decoder (through the wrapper) to hidden states, then the fused op on
    the lm_head weight, which neither wrapper sees a forward of."""
    from grpo_fast import fused_linear_logprobs
    from grpo_fast.train.forward import policy_parts

    hidden = forward(input_ids=ids[:, :-1]).last_hidden_state  # (1, T, H)
    _, weight, _ = policy_parts(lm)
    return -fused_linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, ids[:, 1:].reshape(-1)).mean()


def repeat(fn, steps: int) -> list:
    """fn() once untimed (warm-up: DDP rebuilds its buckets, FSDP2 lazily initialises), then `steps` times."""
    fn()
    return [fn() for _ in range(steps)]


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def best_of(runs: list[dict], key: str) -> float:
    return min(r[key] for r in runs)


class CommLog:
    """(kind, payload bytes, seconds) of each collective since the last clear()."""

    def __init__(self):
        self.calls = []

    def clear(self):
        self.calls = []

    def total(self, kind: str) -> dict:
        mine = [c for c in self.calls if c[0] == kind]
        return dict(count=len(mine), payload_bytes=sum(c[1] for c in mine), seconds=sum(c[2] for c in mine))


def timed_wait(log: CommLog, kind: str, nbytes: int, work_fn):
    """Start a collective, wait for it, log its bytes and seconds; the Work comes back for the caller's
    own wait (a no-op now). Waiting here serialises it with compute: the price of timing it alone."""
    start = time.perf_counter()
    work = work_fn()
    work.wait()
    log.calls.append((kind, nbytes, time.perf_counter() - start))
    return work


def wrap(lm, world, strategy: str):
    """(the module to call where the decoder would be, whole weights for the engine: a function
    returning (name, tensor) pairs), from the trainer's own `parallelize`."""
    from grpo_fast import distributed

    parallel = distributed.parallelize(lm, world, strategy)
    return parallel.forward, parallel.full_weights


def measure_ddp(shape: str, tokens: int, steps: int, world) -> dict:
    """DDP's forward+backward without and with the gradient all-reduce, the all-reduce timed per bucket
    by a blocking comm hook, and the weight sync's copy (no communication: the params are whole)."""
    import torch
    import torch.distributed as dist

    lm = build_lm(shape)
    ddp, whole_weights = wrap(lm, world, "ddp")
    log = CommLog()

    def blocking_all_reduce(_state, bucket):
        grads = bucket.buffer()
        timed_wait(log, "all_reduce", grads.numel() * grads.element_size(),
                   lambda: dist.all_reduce(grads, async_op=True))
        grads.div_(world.size)  # DDP averages
        fut = torch.futures.Future()
        fut.set_result(grads)
        return fut

    ddp.register_comm_hook(None, blocking_all_reduce)
    ids = micro_batch(shape, tokens, world.rank)

    def step(sync: bool):
        lm.zero_grad(set_to_none=True)
        log.clear()
        dist.barrier()  # both ranks start together, so one does not time the other's lateness
        start = time.perf_counter()
        if sync:
            loss_of(ddp, lm, ids).backward()
        else:
            with ddp.no_sync():
                loss_of(ddp, lm, ids).backward()
        wall = time.perf_counter() - start
        return dict(wall_s=wall, **{f"all_reduce_{k}": v for k, v in log.total("all_reduce").items()})

    compute = repeat(lambda: step(False), steps)
    synced = repeat(lambda: step(True), steps)
    engine = {name: torch.empty_like(p) for name, p in lm.named_parameters()}
    copy = repeat(lambda: dict(wall_s=copy_into_engine(whole_weights(), engine)), steps)
    reduce = bandwidths("all_reduce", median_of(synced, "all_reduce_payload_bytes"), world.size,
                        median_of(synced, "all_reduce_seconds"), best_of(synced, "all_reduce_seconds"))
    return dict(params=sum(p.numel() for p in lm.parameters()), compute_s=median_of(compute, "wall_s"),
                step_s=median_of(synced, "wall_s"), all_reduce=dict(buckets=synced[-1]["all_reduce_count"], **reduce),
                sync_copy_s=median_of(copy, "wall_s"), runs=dict(compute=compute, synced=synced))


def copy_into_engine(pairs, engine: dict) -> float:
    """Seconds copying (name, whole tensor) pairs into the engine's tensors, a bucket at a time (64
    MiB, as the engines' update_weights bounds its memory); the pairs' own gathering is not counted."""
    copy_s, bucket, size = 0.0, [], 0

    def flush():
        nonlocal copy_s
        start = time.perf_counter()
        for name, tensor in bucket:
            engine[name].copy_(tensor)
        copy_s += time.perf_counter() - start

    for name, tensor in pairs:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= SYNC_BUCKET_BYTES:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()
    return copy_s


def per_parameter_gathers(lm, log: CommLog):
    """(name, whole tensor) for each parameter, each gathered by `DTensor.full_tensor()` (one
    collective per parameter: what an engine's update_weights does when handed the sharded module)."""
    for name, param in lm.named_parameters():
        start = time.perf_counter()
        tensor = param.detach().full_tensor()
        tensor = tensor.wait() if hasattr(tensor, "wait") else tensor  # an AsyncCollectiveTensor: done now
        log.calls.append(("all_gather", tensor.numel() * tensor.element_size(), time.perf_counter() - start))
        yield name, tensor


def timed_comms(log: CommLog):
    """FSDP2 all-gather and reduce-scatter comms that log and time each collective (the defaults' calls)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return timed_wait(log, "all_gather", output_tensor.numel() * output_tensor.element_size(),
                              lambda: super(TimedAllGather, self).__call__(output_tensor, input_tensor, group, async_op=True))

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return timed_wait(log, "reduce_scatter", input_tensor.numel() * input_tensor.element_size(),
                              lambda: super(TimedReduceScatter, self).__call__(output_tensor, input_tensor, group, op,
                                                                               async_op=True))

    return TimedAllGather(), TimedReduceScatter()


def shard(lm, world, log: CommLog):
    """The FSDP2 root (every decoder layer a unit, then the root: embeddings, final norm and the tied
    lm_head), every unit given the timed comms; and the trainer's whole-weights iterator."""
    from torch.distributed.fsdp import FSDPModule

    root, whole_weights = wrap(lm, world, "fsdp2")
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        gather, scatter = timed_comms(log)
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)
    return root, len(units), whole_weights


def measure_fsdp2(shape: str, tokens: int, steps: int, world) -> dict:
    """One FSDP2 micro-batch without and with the gradient reduce-scatter, and the weight sync: the
    trainer's (one all-gather per unit, `Parallel.full_weights`) and per parameter (`full_tensor()`)."""
    import torch
    import torch.distributed as dist

    lm = build_lm(shape)
    log = CommLog()
    root, units, whole_weights = shard(lm, world, log)
    ids = micro_batch(shape, tokens, world.rank)
    layer_bytes = sum(p.numel() * p.element_size() for p in lm.model.layers.parameters())  # a DTensor's numel is the whole's

    def step(sync: bool):
        lm.zero_grad(set_to_none=True)
        root.set_requires_gradient_sync(sync)  # recurses into the layers: accumulation without the reduce-scatter
        log.clear()
        dist.barrier()
        start = time.perf_counter()
        loss_of(root, lm, ids).backward()
        wall = time.perf_counter() - start
        run = dict(wall_s=wall)
        for kind in ("all_gather", "reduce_scatter"):
            run.update({f"{kind}_{k}": v for k, v in log.total(kind).items()})
        return run

    no_sync = repeat(lambda: step(False), steps)
    synced = repeat(lambda: step(True), steps)
    engine = {name: torch.empty(p.shape, dtype=p.dtype) for name, p in lm.named_parameters()}

    def sync_weights(pairs):
        log.clear()
        dist.barrier()
        start = time.perf_counter()
        copy_s = copy_into_engine(pairs(), engine)
        return dict(wall_s=time.perf_counter() - start, copy_s=copy_s,
                    **{f"all_gather_{k}": v for k, v in log.total("all_gather").items()})

    def summary(runs: list[dict]) -> dict:
        gathered = bandwidths("all_gather", median_of(runs, "all_gather_payload_bytes"), world.size,
                              median_of(runs, "all_gather_seconds"), best_of(runs, "all_gather_seconds"))
        return dict(count=runs[-1]["all_gather_count"], wall_s=median_of(runs, "wall_s"), copy_s=median_of(runs, "copy_s"),
                    **gathered, runs=runs)

    syncs = {"per_parameter": summary(repeat(lambda: sync_weights(lambda: per_parameter_gathers(lm, log)), steps)),
             "trainer": summary(repeat(lambda: sync_weights(whole_weights), steps))}
    return dict(
        layer_bytes=layer_bytes, units=units,
        micro_no_sync_s=median_of(no_sync, "wall_s"), micro_sync_s=median_of(synced, "wall_s"),
        micro_sync_comm_s=statistics.median(r["all_gather_seconds"] + r["reduce_scatter_seconds"] for r in synced),
        all_gather=dict(count=no_sync[-1]["all_gather_count"],
                        **bandwidths("all_gather", median_of(no_sync, "all_gather_payload_bytes"), world.size,
                                     median_of(no_sync, "all_gather_seconds"), best_of(no_sync, "all_gather_seconds"))),
        reduce_scatter=dict(count=synced[-1]["reduce_scatter_count"],
                            **bandwidths("reduce_scatter", median_of(synced, "reduce_scatter_payload_bytes"), world.size,
                                         median_of(synced, "reduce_scatter_seconds"), best_of(synced, "reduce_scatter_seconds"))),
        weight_sync=syncs, runs=dict(no_sync=no_sync, synced=synced))


def run_ranks(args) -> None:
    """Under torchrun: both measurements on every rank; rank 0 writes its figures to --ranks-out."""
    import torch
    import torch.distributed as dist

    from grpo_fast.distributed import join

    torch.set_num_threads(1)  # one core per rank: the 2 ranks share the 2 cores
    world = join()
    result = dict(ranks=world.size, backend=dist.get_backend(), model=args.model, tokens=args.tokens, steps=args.steps)
    result["ddp"] = measure_ddp(args.model, args.tokens, args.steps, world)
    harness.release_memory()  # the DDP model's memory back before the sharded one is built
    result["fsdp2"] = measure_fsdp2(args.model, args.tokens, args.steps, world)
    if world.main:
        Path(args.ranks_out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def formula_check(measured: dict) -> dict:
    """The formulas' payloads at the measured model's P and b against what the collectives moved."""
    n, params, b = measured["ranks"], measured["ddp"]["params"], 4  # fp32 on the CPU
    fsdp = measured["fsdp2"]
    root_bytes = params * b - fsdp["layer_bytes"]  # gathered once per micro-batch: not resharded after forward
    return dict(
        ddp_all_reduce=(params * b, measured["ddp"]["all_reduce"]["payload_bytes"]),
        fsdp2_all_gather_per_micro_batch=(2 * params * b, fsdp["all_gather"]["payload_bytes"]),
        fsdp2_all_gather_exact=(2 * fsdp["layer_bytes"] + root_bytes, fsdp["all_gather"]["payload_bytes"]),
        fsdp2_reduce_scatter=(params * b, fsdp["reduce_scatter"]["payload_bytes"]),
        **{f"fsdp2_weight_sync_{k}": (params * b, v["payload_bytes"]) for k, v in fsdp["weight_sync"].items()}, ranks=n)


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _rate(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(report: dict) -> str:
    m = report["measured"]
    ddp, fsdp = m["ddp"], m["fsdp2"]
    n = m["ranks"]
    syncs = fsdp["weight_sync"]
    rows = [("DDP gradient all-reduce (per step)", f"{ddp['all_reduce']['buckets']} buckets of <= {DDP_BUCKET_MB} MiB", ddp["all_reduce"]),
            ("FSDP2 all-gathers (per micro-batch: forward + backward)", f"{fsdp['all_gather']['count']} all-gathers, {fsdp['units']} units",
             fsdp["all_gather"]),
            ("FSDP2 gradient reduce-scatter (per step)", f"{fsdp['reduce_scatter']['count']} reduce-scatters", fsdp["reduce_scatter"])]
    rows += [(f"weight sync, FSDP2, {SYNC_WAYS[way]} (per step)", f"{c['count']} all-gathers", c) for way, c in syncs.items()]
    lines = [
        "# Communication per step: DDP, FSDP2, and the weight sync",
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['wall_s']:.0f} s)",
        "",
        f"Machine: CPU from /proc/cpuinfo {report['environment']['cpu']}, {report['environment']['cores']} cores, "
        f"torch {report['environment']['torch']}. Load average {report['environment']['load_average']} at the start, "
        f"{report['load_average_end']} at the end" + (
            f". **Timings are from a shared machine** (load average above half its {report['environment']['cores']} cores: other jobs "
            "ran at the same time), so seconds vary run to run; the byte counts do not."
            if report["environment"]["load_average"][0] > 0.5 * report["environment"]["cores"] else
            " (the machine otherwise idle)."),
        "",
        f"Setup: {n} ranks, {m['backend']} over loopback, one thread each (OMP_NUM_THREADS=1); {report['model_note']}; "
        f"{ddp['params'] / 1e6:.1f}M parameters (tied embeddings counted once), fp32, so {_mb(ddp['params'] * 4)} MiB of "
        f"weights or gradients; each rank's micro-batch {m['tokens']} tokens; median of {m['steps']} runs after a warm-up.",
        "",
        "## Measured on the CPU ranks",
        "",
        "Bytes per rank. Payload: the tensor handed in (all-reduce) or whole (all-gather output, reduce-scatter "
        f"input). Wire: what each rank sends in a ring, 2(N-1)/N x payload (all-reduce) or (N-1)/N x payload, here N={n}. "
        "algbw = payload/s, busbw = wire/s. Each collective is waited for as it starts so that it is timed alone.",
        "",
        "| communication | collectives | payload MiB | wire MiB | seconds (median) | best s | algbw GB/s | busbw GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, count, c in rows:
        lines.append(f"| {name} | {count} | {_mb(c['payload_bytes'])} | {_mb(c['wire_bytes'])} | {c['seconds']:.3f} | "
                     f"{c['best_s']:.3f} | {_rate(c['algbw_GBps'])} | {_rate(c['busbw_GBps'])} |")
    lines += [
        f"| weight sync, DDP: copy only (per step) | none | 0 | 0 | {ddp['sync_copy_s']:.3f} (copy) | - | - | - |",
        "",
        "Whole micro-batches (forward + backward of the trainer's loss, seconds):",
        "",
        "| | seconds | of which communication |",
        "| --- | --- | --- |",
        f"| unsharded, DDP under no_sync() (compute only) | {ddp['compute_s']:.3f} | 0 |",
        f"| DDP, gradients all-reduced | {ddp['step_s']:.3f} | {ddp['all_reduce']['seconds']:.3f} |",
        f"| FSDP2, gradient sync off (all-gathers) | {fsdp['micro_no_sync_s']:.3f} | {fsdp['all_gather']['seconds']:.3f} |",
        f"| FSDP2, gradient sync on (all-gathers + reduce-scatter) | {fsdp['micro_sync_s']:.3f} | "
        f"{fsdp['micro_sync_comm_s']:.3f} |",
        *[f"| weight sync under FSDP2, {SYNC_WAYS[way]} (gathers + copy into the engine) | {c['wall_s']:.3f} | "
          f"{c['seconds']:.3f} (copy {c['copy_s']:.3f}) |" for way, c in syncs.items()],
        "",
        "Formula check, payload bytes per rank at this model's P (fp32) against what the collectives moved:",
        "",
        "| | formula MiB | counted MiB |",
        "| --- | --- | --- |",
    ]
    labels = dict(ddp_all_reduce="DDP all-reduce, P·b", fsdp2_all_gather_per_micro_batch="FSDP2 all-gathers per micro-batch, 2·P·b",
                  fsdp2_all_gather_exact="... exactly: 2·layers + root once", fsdp2_reduce_scatter="FSDP2 reduce-scatter, P·b",
                  **{f"fsdp2_weight_sync_{way}": f"weight sync, {SYNC_WAYS[way]}, P·b" for way in syncs})
    for key, label in labels.items():
        formula, counted = report["formula_check"][key]
        lines.append(f"| {label} | {_mb(formula)} | {_mb(counted)} |")
    lines += model_section(report["scaling"])
    lines += ["", "## Notes", "", *[f"- {note}" for note in report["notes"]]]
    return "\n".join(lines) + "\n"


def notes(measured: dict) -> list[str]:
    """What the measured figures say, computed from them (not written in ahead of the run)."""
    ddp, fsdp = measured["ddp"], measured["fsdp2"]
    syncs = fsdp["weight_sync"]
    lines = [
        f"gloo over loopback reached {_rate(ddp['all_reduce']['busbw_GBps'])} GB/s busbw in DDP's all-reduce, "
        f"{_rate(fsdp['all_gather']['busbw_GBps'])} in FSDP2's all-gathers and {_rate(fsdp['reduce_scatter']['busbw_GBps'])} in "
        f"its reduce-scatter: about {FABRICS[0][2] / 1e9 / ddp['all_reduce']['busbw_GBps']:.0f}x under NVLink's 450 GB/s, so "
        "the CPU seconds size nothing on GPUs; the byte counts (which the formula check confirms) and the written model "
        f"do. Bytes do not depend on the tokens per micro-batch, compute does: the shares below are those of a "
        f"{measured['tokens']}-token micro-batch.",
        f"Communication's share of a micro-batch here: DDP {ddp['all_reduce']['seconds'] / ddp['step_s']:.0%}, FSDP2 with "
        f"sync {fsdp['micro_sync_comm_s'] / fsdp['micro_sync_s']:.0%}; FSDP2's "
        f"micro-batch without sync took {fsdp['micro_no_sync_s'] / ddp['compute_s']:.2f}x the unsharded compute.",
        f"Under DDP the weight sync is a copy ({ddp['sync_copy_s']:.3f} s); under FSDP2 it is one more all-gather of the "
        "whole model per step, the bytes of the reduce-scatter again.",
    ]
    if "trainer" in syncs:
        t, q = syncs["trainer"], syncs["per_parameter"]
        lines.append(f"Weight sync: the trainer's way ({t['count']} all-gathers, one per unit) took {t['wall_s']:.3f} s, "
                     f"{t['seconds']:.3f} s of it in collectives; one full_tensor() per parameter ({q['count']} collectives) "
                     f"{q['wall_s']:.3f} s, {q['seconds']:.3f} s in collectives, for the same bytes. The trainer's way spends "
                     f"{t['wall_s'] - t['seconds'] - t['copy_s']:.3f} s outside its collectives and the engine copy: FSDP2's "
                     "copy-out of each gathered unit into its parameters and the clone() of each tensor it yields.")
    return lines


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def pick_model(requested: str, nproc: int) -> tuple[str, str]:
    """The shape to run and a sentence on it: the tiny shape when the ranks would not fit in memory
    (per rank: weights, grads, DDP's buckets, the engine copy, ~1 GiB of activations and runtime)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**SHAPES[requested])).parameters())
    need = nproc * (4 * params * 4 + (1 << 30))
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    shape_note = f"{requested} shape ({SHAPES[requested]['num_hidden_layers']} layers, hidden {SHAPES[requested]['hidden_size']})"
    if requested != "tiny" and need > 0.8 * available:
        return "tiny", f"tiny shape: {shape_note} needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
    return requested, f"LlamaForCausalLM of the {shape_note}, random weights"


def launch(args) -> dict:
    """Run this file under torch.distributed.run and return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               __file__, "--model", args.model, "--steps", str(args.steps), "--tokens", str(args.tokens),
               "--ranks-out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, env=env, timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"the ranks failed (exit {done.returncode}): see their output above")
        return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(SHAPES), help="model shape (random weights)")
    parser.add_argument("--steps", type=int, default=3, help="timed repeats of each measurement, after one warm-up")
    parser.add_argument("--tokens", type=int, default=64, help="tokens in each rank's micro-batch")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one CPU core each)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="writes <output>.md and <output>.json")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds for the ranks")
    parser.add_argument("--ranks-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # a rank under torch.distributed.run
        run_ranks(args)
        return
    start = time.perf_counter()
    command = harness.command_line(__file__)
    env = harness.environment()  # before the ranks start: the load average is the other jobs'
    args.model, model_note = pick_model(args.model, args.nproc)
    measured = launch(args)
    report = dict(command=command, date=date.today().isoformat(), machine=harness.describe(env), environment=env,
                  model_note=model_note, measured=measured, formula_check=formula_check(measured),
                  scaling=scaling_table(), notes=notes(measured), wall_s=time.perf_counter() - start,
                  load_average_end=harness.load_average())
    report["notes"] += scaling_notes(report["scaling"])
    text = markdown(report)
    harness.write_results(Path(args.output), report, text)
    print(text)


if __name__ == "__main__":
    main()

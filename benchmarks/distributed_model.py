"""The written model of communication per optimizer step on many GPUs: bytes per rank for DDP's
gradient all-reduce, FSDP2's all-gathers and reduce-scatter and the weight sync into each rank's
engine, and the seconds they take at NVLink and InfiniBand rates, with memory per GPU. Its formulas
are checked against the bytes the collectives really moved by benchmarks/bench_distributed.py, which
prints this model in its report.

    python benchmarks/distributed_model.py --params 7e9 32e9 --ranks 8 16 64

sizes a run before it is rented (bandwidth term only: lower bounds; see the notes in the table).
"""

from __future__ import annotations

import argparse

# The written model's hardware, bus bandwidth per GPU (what a ring collective can move per rank per
# second). NVLink 4 (H100/H200): 900 GB/s bidirectional = 450 GB/s each way. Across nodes the ring's
# slowest hop is the inter-node one: one 400 Gb/s NIC per GPU (8 per node, rail-optimised) = 50 GB/s.
# Peak rates: NCCL typically reaches 70-90% of them on large messages, so the seconds are lower bounds.
FABRICS = [("1 node, NVLink", 8, 450e9), ("2 nodes, IB 400 Gb/s per GPU", 16, 50e9),
           ("8 nodes, IB 400 Gb/s per GPU", 64, 50e9)]
MODEL_SIZES = [0.135e9, 1.5e9, 7e9, 32e9]
GPU_BYTES_PER_ELEMENT = 2  # the trainer's CUDA default: bf16 weights, so bf16 grads and bf16 weight sync
STATE_BYTES_PER_PARAM = 8  # bf16 weights + grads + AdamW's two moments (kept in the param dtype)


def step_bytes(params: float, b: float, n: int) -> dict:
    """Wire bytes per rank per optimizer step, for P params of b bytes each on n ranks (ring):
    DDP all-reduce 2(N-1)/N·P·b; FSDP2 all-gathers 2·(N-1)/N·P·b per micro-batch (forward, and again in
    backward after resharding; the root unit is gathered once, so slightly less); FSDP2 reduce-scatter
    (N-1)/N·P·b; weight sync (FSDP2) (N-1)/N·P·b, nothing under DDP."""
    share = (n - 1) / n * params * b
    return dict(ddp_all_reduce=2 * share, fsdp2_all_gather_per_micro_batch=2 * share,
                fsdp2_reduce_scatter=share, fsdp2_weight_sync=share)


def scaling_table(sizes=MODEL_SIZES, fabrics=FABRICS) -> list[dict]:
    """One row per model size and fabric (name, ranks, bus bandwidth per GPU in bytes/s)."""
    rows = []
    for params in sizes:
        for fabric, n, busbw in fabrics:
            wire = step_bytes(params, GPU_BYTES_PER_ELEMENT, n)
            fsdp2_step = wire["fsdp2_all_gather_per_micro_batch"] + wire["fsdp2_reduce_scatter"] + wire["fsdp2_weight_sync"]
            rows.append(dict(
                params=params, fabric=fabric, ranks=n, busbw_GBps=busbw / 1e9, wire_bytes=wire,
                ddp_step_s=wire["ddp_all_reduce"] / busbw, fsdp2_step_s=fsdp2_step / busbw,
                fsdp2_per_extra_micro_batch_s=wire["fsdp2_all_gather_per_micro_batch"] / busbw,
                ddp_memory_GB=params * (STATE_BYTES_PER_PARAM + GPU_BYTES_PER_ELEMENT) / 1e9,
                fsdp2_memory_GB=params * (STATE_BYTES_PER_PARAM / n + GPU_BYTES_PER_ELEMENT) / 1e9))
    return rows


def model_section(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## The model: bytes and seconds per step on GPUs",
        "",
        "P parameters of b bytes, N ranks, A micro-batches per optimizer step, ring collectives, wire bytes per rank:",
        "",
        "- DDP gradient all-reduce, once per step: `2(N-1)/N · P · b`; weight sync: 0 (the weights are whole on every rank).",
        "- FSDP2 all-gathers, every micro-batch: `2 · (N-1)/N · P · b` (each layer in forward, again in backward after "
        "`reshard_after_forward`; the root unit, embeddings and a tied lm_head, only once, so this slightly overstates).",
        "- FSDP2 gradient reduce-scatter, once per step: `(N-1)/N · P · b`.",
        "- Weight sync under FSDP2, once per step: `(N-1)/N · P · b` (every rank gathers the whole model for its engine).",
        "- So a DDP step moves `2(N-1)/N·P·b`; an FSDP2 step `(2A + 2)(N-1)/N·P·b`: twice DDP's at A=1, and "
        "each extra micro-batch adds an all-gather pass.",
        "- Seconds = wire bytes / bus bandwidth, bandwidth term only: add about 2L+1 collective latencies per "
        "micro-batch under FSDP2 (L layers), which matter for small models across nodes.",
        "",
        f"Evaluated at b = {GPU_BYTES_PER_ELEMENT} (bf16, the trainer's CUDA default; fp32 doubles every figure) and A = 1. "
        "Bus bandwidth per GPU: NVLink 450 GB/s (H100/H200, 900 GB/s bidirectional); across nodes 50 GB/s "
        "(one 400 Gb/s InfiniBand NIC per GPU, the inter-node hop bounds the ring). Peak rates: expect 70-90% of them, "
        "so the seconds are lower bounds. Memory per GPU: training state at "
        f"{STATE_BYTES_PER_PARAM} B/param (bf16 weights, grads, AdamW's 2 moments), whole under DDP, /N under FSDP2, "
        f"plus the colocated engine's whole bf16 weights ({GPU_BYTES_PER_ELEMENT} B/param; KV cache and activations not counted).",
        "",
        "| params | fabric | N | DDP all-reduce GB | FSDP2 all-gathers GB / micro-batch | FSDP2 reduce-scatter GB | "
        "weight sync GB (FSDP2) | DDP step s (all-reduce) | FSDP2 step s (A=1: gathers + reduce-scatter + sync) | "
        "+ per extra micro-batch s | memory/GPU GB DDP / FSDP2 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        w = r["wire_bytes"]
        lines.append(
            f"| {r['params'] / 1e9:g}B | {r['fabric']} | {r['ranks']} | {w['ddp_all_reduce'] / 1e9:.2f} | "
            f"{w['fsdp2_all_gather_per_micro_batch'] / 1e9:.2f} | {w['fsdp2_reduce_scatter'] / 1e9:.2f} | "
            f"{w['fsdp2_weight_sync'] / 1e9:.2f} | {r['ddp_step_s']:.4f} | {r['fsdp2_step_s']:.4f} | "
            f"{r['fsdp2_per_extra_micro_batch_s']:.4f} | {r['ddp_memory_GB']:.1f} / {r['fsdp2_memory_GB']:.1f} |")
    return lines


def scaling_notes(rows: list[dict]) -> list[str]:
    """What the written model's table says for sizing a run."""
    at = {(r["params"], r["ranks"]): r for r in rows}
    big, node, nodes = MODEL_SIZES[-1], FABRICS[0][1], FABRICS[-1][1]
    return [
        f"Bytes per rank hardly grow with N ((N-1)/N -> 1): from {FABRICS[1][1]} to {nodes} ranks a rank's bytes grow "
        f"{at[(big, nodes)]['wire_bytes']['ddp_all_reduce'] / at[(big, FABRICS[1][1])]['wire_bytes']['ddp_all_reduce']:.2f}x, "
        "so with a fixed global batch the communication time stays flat while each rank's compute shrinks: "
        "more ranks raise the communication's share of a step.",
        f"Leaving the node costs {FABRICS[0][2] / FABRICS[1][2]:.0f}x (450 vs 50 GB/s per GPU): at {big / 1e9:g}B an "
        f"FSDP2 step's communication is {at[(big, node)]['fsdp2_step_s']:.2f} s on one NVLink node and "
        f"{at[(big, nodes)]['fsdp2_step_s']:.2f} s on {nodes // 8} nodes, plus "
        f"{at[(big, nodes)]['fsdp2_per_extra_micro_batch_s']:.2f} s per extra micro-batch; FSDP2's communication "
        "overlaps with compute (the next layer's all-gather during this one's), DDP's all-reduce with the backward, "
        "the weight sync with nothing (the engine waits for it).",
        f"Memory decides the strategy before bandwidth does: DDP keeps {STATE_BYTES_PER_PARAM} B/param of state whole on "
        f"every GPU (7B: {at[(7e9, node)]['ddp_memory_GB']:.0f} GB with the engine's copy before KV cache and activations, "
        f"tight on an 80 GB H100, room on a 141 GB H200; 32B: {at[(big, node)]['ddp_memory_GB']:.0f} GB, on no GPU), so past "
        "a few billion parameters the choice is FSDP2 and its twice-per-micro-batch all-gathers; the engine's whole "
        "weights stay on every GPU either way.",
    ]




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=MODEL_SIZES, help="parameter counts, e.g. 7e9")
    parser.add_argument("--ranks", type=int, nargs="+", default=[n for _, n, _ in FABRICS],
                        help="GPUs; up to 8 on one NVLink node (450 GB/s), more across nodes (50 GB/s per GPU)")
    args = parser.parse_args()
    fabrics = [("1 node, NVLink" if n <= 8 else f"{-(-n // 8)} nodes, IB 400 Gb/s per GPU", n, 450e9 if n <= 8 else 50e9)
               for n in args.ranks]
    print("\n".join(model_section(scaling_table(args.params, fabrics))))


if __name__ == "__main__":
    main()

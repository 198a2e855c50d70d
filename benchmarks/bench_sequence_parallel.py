"""Sequence parallelism (Ulysses) on the CPU: peak memory per rank and step time of one packed row, N = 1 vs N = 3,
with and without gradient checkpointing; the all-to-all bytes against their formula; a 7B projection.

    python benchmarks/bench_sequence_parallel.py                  # the sweep and the projection -> results/sequence_parallel_cpu.*
    python benchmarks/bench_sequence_parallel.py --lengths 2048   # a shorter sweep
    python benchmarks/bench_sequence_parallel.py --project        # the 7B projection alone (no runs)
    python benchmarks/bench_sequence_parallel.py --only-checkpointing  # rerun the rows with checkpointing
    python benchmarks/bench_sequence_parallel.py --report         # the report again from the saved json

The model: SmolLM2-135M's width (hidden 576, 9 query heads, 3 KV heads of 64, MLP 1536, vocab 49152, tied
embeddings) with 4 layers instead of 30 (the whole model is too slow for 8k-token rows on 2 cores), random weights,
float32. One packed row: one sequence, a 256-token prompt and a completion filling the row (2k, 4k, 8k tokens), the
train step's forward and backward through the decoder and the loss (dapo), three ways, each in processes of its own:

- "N=1": one process, the trainer's path today (per-sequence SDPA; under checkpointing the dense block mask, which
  `train/attention.py` selects there) and the fused loss.
- "N=1 sp": one rank of a sequence-parallel group of 1 (torchrun): the sharded path, whose attention is the
  per-sequence SDPA with or without checkpointing (the Ulysses swap spans the backward) and whose loss is the
  log-prob op plus the spec (train/sequence_parallel.py): the like-for-like baseline of N = 3.
- "N=3": three ranks (torchrun, gloo), each a third of the row.

Memory: each rank's peak RSS during the measured step (VmHWM, reset at its start) minus its RSS at the start, with
the parameters' gradients allocated before; the step before it is a warm-up. That extra memory holds a fixed part:
parameter-sized transients, the lm_head's and the embedding's [V, H] float32 gradients (113 MB each at this width)
and the loss's logit slabs (32 MiB each, row_ops.SLAB_BYTES: bounded by design, full from 171 rows a rank on), the
same at any N and any length; and the part that grows with the row: activations and the loss's per-token memory,
what sequence parallelism divides. The fixed part is measured on a base row of 768 tokens (256 a rank at N = 3,
so every slab is already full: a shorter base row would count the slabs' filling up as growth, which does not
divide by N), and the growing part is a row's memory over the base row's. Target: N=3's growing part per rank at
most 1.1 x (N=1 sp's / 3). Memory is reported twice: RSS, and torch's own tensor bytes (the profiler's running
sum of allocations minus frees, its peak over the step: no C allocator caching or fragmentation in it).
Time: the measured step's wall time; three ranks share this machine's 2 cores, so N=3's times are not a speedup
measurement (on a GPU each rank has its own device).

All-to-all bytes a rank sends in a step (`train/ulysses.py` counts them), stated formula:

    layers x passes x (N - 1) / N x S x head_dim x bytes x (2 Hq + 2 Hkv')

S = ceil(L / N) tokens per rank; q and the attention output have Hq heads, k and v Hkv' = max(Hkv, N) (KV heads
repeated where N > Hkv); each all-to-all keeps 1/N of its tensor; passes: 2 (forward, backward), 3 under
checkpointing (the forward recomputed in the backward). (The loss adds two all-reduces of the micro-batch's
log-probs and entropies, b x Tc floats each.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sequence_parallel_cpu"
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=16384, num_hidden_layers=4)
PROMPT = 256
BASE = 768  # the base row (module docstring): 256 prompt tokens, 512 completion tokens
TARGET = 1.1


def all_to_all_bytes(length: int, n: int, *, layers: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                     checkpointing: bool) -> int:
    """The formula of the module docstring: bytes one rank sends in the all-to-alls of one step."""
    if n == 1:
        return 0
    tokens = math.ceil(length / n)
    passes = 3 if checkpointing else 2
    per_token = head_dim * dtype_bytes * (2 * heads + 2 * max(kv_heads, n))
    return layers * passes * tokens * per_token * (n - 1) // n


# ---- one process (or rank) of the sweep --------------------------------------------------------


def worker(mode: str, lengths: list[int], checkpointing: bool) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_fast.objective import LossOptions
    from grpo_fast.ops import fused_linear_grpo_loss
    from grpo_fast.train import sequence_parallel as sp
    from grpo_fast.train import ulysses
    from grpo_fast.train.forward import attention_mode, completion_hidden, policy_parts
    from grpo_fast.train.packing import pack_sequences

    torch.set_num_threads(1 if mode != "N=1" else int(os.environ.get("OMP_NUM_THREADS", "2")))
    group = None
    if mode != "N=1":
        dist.init_process_group("gloo")
        group = sp.Group(dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(dist.get_world_size()))))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).float().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # (in the baseline: the step's extra memory is activations, loss, transients)
    base, weight, bias = policy_parts(model)
    options = LossOptions(loss_type="dapo")
    g = torch.Generator().manual_seed(1)
    for length in [BASE, *lengths]:
        prompt = torch.randint(3, SMOLLM2["vocab_size"], (PROMPT,), generator=g).tolist()
        completion = torch.randint(3, SMOLLM2["vocab_size"], (length - PROMPT + 1,), generator=g).tolist()
        attention = attention_mode(model) if group is None else "packed"
        mb = pack_sequences([prompt], [completion], [0], attention=attention)
        inputs = dict(advantages=torch.tensor([0.5]), mask=mb.completion_mask, options=options,
                      num_items_in_batch=mb.completion_mask.sum())

        def step(mb=mb, inputs=inputs, held=None):
            mine = None if group is None else sp.shard(mb, group, base)
            with contextlib.nullcontext() if group is None else sp.attending(base, mine):
                with contextlib.nullcontext() if held is None else forward_bytes(held):
                    if group is None:
                        hidden = completion_hidden(base, mb)
                        loss, _ = fused_linear_grpo_loss(hidden, weight, mb.target_ids, bias=bias, **inputs)
                    else:
                        hidden = completion_hidden(base, mine)
                        loss, _ = sp.loss_of(mine)(hidden, weight, mine.target_ids, bias=bias, **inputs)
                loss.backward()

        step()  # warm-up
        harness.release_memory()
        sent = ulysses.BYTES["sent"]
        with harness.PeakMemory(reset_rss_peak=True) as memory:
            seconds = harness.time_call(step)
        sent = ulysses.BYTES["sent"] - sent
        tensors = torch_peak_bytes(step)  # (a step of its own: the profiler slows it)
        held = []
        step(held=held)
        row = {"mode": mode, "tokens": length, "checkpointing": checkpointing, "attention": attention,
               "extra_mb": memory.extra_bytes / 2**20, "tensor_mb": tensors / 2**20,
               "held_mb": held[0] / 2**20, "held_python_mb": held[1] / 2**20, "step_s": seconds, "all_to_all_bytes": sent}
        rows = [row] if group is None else [None] * group.size
        if group is not None:
            dist.all_gather_object(rows, row)
        if group is None or group.rank == 0:
            ranks = len(rows)
            print(json.dumps({**row, "ranks": ranks, "extra_mb": max(r["extra_mb"] for r in rows),
                              "extra_mb_per_rank": [r["extra_mb"] for r in rows],
                              "tensor_mb": max(r["tensor_mb"] for r in rows),
                              "tensor_mb_per_rank": [r["tensor_mb"] for r in rows],
                              "held_mb": max(r["held_mb"] for r in rows),
                              "held_mb_per_rank": [r["held_mb"] for r in rows],
                              "held_python_mb": max(r["held_python_mb"] for r in rows),
                              "held_python_mb_per_rank": [r["held_python_mb"] for r in rows],
                              "step_s": max(r["step_s"] for r in rows),
                              "all_to_all_bytes_per_rank": [r["all_to_all_bytes"] for r in rows]}), flush=True)


@contextlib.contextmanager
def forward_bytes(out: list):
    """Appends to `out` the tensor bytes the block left allocated, counted two ways: (1) the profiler's allocation
    events of the block, net (as `torch_peak_bytes`): every tensor the forward leaves for the backward (activations
    saved or checkpointed, the loss's saved tensors), but also what other threads (gloo's) allocate meanwhile; (2)
    the storages of the tensors Python can see that the block created (gc): under checkpointing that is everything
    the forward keeps, the layers' checkpointed inputs, whatever threads run beside it."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and id(o) not in before and not isinstance(o, torch.nn.Parameter):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    out += [sum(event.self_cpu_memory_usage for event in prof.events()), sum(storages.values())]


def torch_peak_bytes(step) -> int:
    """The most bytes torch's tensors held at once during `step()`, over what they held at its start: the running sum
    of every profiled op's own allocations minus its frees, in time order (op granularity: a peak inside one op is
    its net). Free of the C allocator's caching and fragmentation, which the RSS figure carries."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


# ---- the sweep ------------------------------------------------------------------------------------


def launch(mode: str, lengths: list[int], checkpointing: bool) -> list[dict]:
    me = [str(Path(__file__).resolve()), "--worker", mode, "--lengths", *map(str, lengths)] + \
        (["--checkpointing"] if checkpointing else [])
    if mode == "N=1":
        cmd = [sys.executable, *me]
    else:
        ranks = 1 if mode == "N=1 sp" else 3
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *me]
    env = dict(os.environ, OMP_NUM_THREADS="2" if mode == "N=1" else "1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{mode}: {done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def sweep(lengths: list[int], settings=(False, True)) -> list[dict]:
    rows = []
    for checkpointing in settings:
        for mode in ("N=1", "N=1 sp", "N=3"):
            rows += launch(mode, lengths, checkpointing)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _growth(by: dict, base: dict, key: str):
    """Each mode's `key` over its base row's (None: not measured in these rows)."""
    return {m: r[key] - base[m][key] for m, r in by.items()} if key in by["N=3"] else None


def vs_sp(grown):
    """N=3's growth over the ideal share of N=1 sp's (its / 3): the target's ratio."""
    return grown and grown["N=3"] / (grown["N=1 sp"] / 3)


def summary(rows: list[dict]) -> list[dict]:
    """Per (checkpointing, tokens): the growing memory (over the base row's), its N=3 / (N=1 / 3) ratios, and the
    all-to-all bytes against the formula."""
    out = []
    cfg = SMOLLM2
    for checkpointing in (False, True):
        base = {r["mode"]: r for r in rows if r["tokens"] == BASE and r["checkpointing"] == checkpointing}
        for tokens in sorted({r["tokens"] for r in rows} - {BASE}):
            by = {r["mode"]: r for r in rows if r["tokens"] == tokens and r["checkpointing"] == checkpointing}
            if len(by) < 3:
                continue

            fixed = {m: r["extra_mb"] for m, r in base.items()}
            grows, tensors, held, python = (_growth(by, base, k) for k in ("extra_mb", "tensor_mb", "held_mb", "held_python_mb"))
            formula = all_to_all_bytes(tokens, 3, layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                                       kv_heads=cfg["num_key_value_heads"], head_dim=64, dtype_bytes=4,
                                       checkpointing=checkpointing)
            out.append({"tokens": tokens, "checkpointing": checkpointing,
                        "mb": {m: r["extra_mb"] for m, r in by.items()}, "fixed_mb": fixed, "grows_mb": grows,
                        "ratio_vs_sp": vs_sp(grows),
                        "tensor_mb": {m: r["tensor_mb"] for m, r in by.items()},
                        "tensor_fixed_mb": {m: r["tensor_mb"] for m, r in base.items()},
                        "tensor_grows_mb": tensors, "tensor_ratio_vs_sp": vs_sp(tensors),
                        "held_grows_mb": held, "held_ratio_vs_sp": vs_sp(held),
                        "held_python_grows_mb": python,
                        "held_python_ratio_vs_sp": vs_sp(python),
                        "ratio_vs_today": grows["N=3"] / (grows["N=1"] / 3),
                        "step_s": {m: r["step_s"] for m, r in by.items()},
                        "bytes_measured": by["N=3"]["all_to_all_bytes_per_rank"], "bytes_formula": formula,
                        "bytes_equal": all(b == formula for b in by["N=3"]["all_to_all_bytes_per_rank"])})
    return out


# ---- the 7B projection ----------------------------------------------------------------------------

# Llama-2-7B's shape (32 layers, hidden 4096, 32 heads of 128, 32 KV heads, MLP 11008, vocab 32000, 6.74e9 parameters)
LLAMA_7B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, vocab=32000, params=6.74e9)
# H100 SXM: 80 GB; NVLink 4 at 900 GB/s per GPU both directions together, 450 GB/s each way (NVIDIA's H100 datasheet);
# through the NVSwitch each GPU sends its all-to-all share at that rate at best (a lower bound on the time)
H100 = dict(memory_gb=80, nvlink_gbps_each_way=450, gpus=8)
# verl's working point for a 7B under Ulysses: recipe/dapo/test_dapo_7b_math.sh (volcengine/verl, commit 3592251):
# Qwen2.5-Math-7B, ulysses_sequence_parallel_size=4, ppo_max_token_len_per_gpu = 2 x (2048 + 8192) = 20480, which
# verl's dp_actor multiplies by the SP size (micro-batches of 81920 tokens per group of 4 GPUs, 20480 tokens per GPU),
# gradient checkpointing on, FSDP parameters and optimizer offloaded, 8 nodes x 8 GPUs. It states no memory figure.
VERL = dict(source="volcengine/verl recipe/dapo/test_dapo_7b_math.sh @3592251", model="Qwen2.5-Math-7B", sp=4,
            tokens_per_gpu=20480, tokens_per_group=81920, checkpointing=True, offload=True)


def project() -> list[dict]:
    """Memory per GPU and all-to-all time per step for the 7B at 32k and 64k tokens a packed row, N = 2, 4, 8 on 8 H100s.

    Model states: float32 weights, gradients and AdamW's two moments (16 bytes a parameter: the trainer's default on
    a GPU keeps float32 weights under bf16 autocast), FSDP2 over the 8 GPUs. Activations (bf16, SDPA / flash: no
    attention scores stored): 34 h bytes a token a layer without checkpointing (Korthikanti et al. 2022, table 2,
    without the 5 a s / h term of stored scores); with checkpointing each layer's input (4 h: the residual stream
    stays float32 under autocast with float32 weights) plus one layer's 34 h during its recompute. The fused loss: the lm_head's float32 gradient buffer (V x h x 4) and 16 bytes a token."""
    m, rows = LLAMA_7B, []
    states = 16 * m["params"] / H100["gpus"] / 1e9
    for tokens in (32768, 65536):
        for n in (2, 4, 8):
            s = math.ceil(tokens / n)
            loss = (m["vocab"] * m["hidden"] * 4 + 16 * s) / 1e9
            plain = m["layers"] * 34 * m["hidden"] * s / 1e9
            ckpt = (m["layers"] * 4 * m["hidden"] * s + 34 * m["hidden"] * s) / 1e9
            sent = all_to_all_bytes(tokens, n, layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"],
                                    head_dim=m["head_dim"], dtype_bytes=2, checkpointing=True)
            rows.append({"tokens": tokens, "n": n, "tokens_per_gpu": s, "states_gb": states,
                         "gb_without_checkpointing": states + plain + loss, "gb_with_checkpointing": states + ckpt + loss,
                         "all_to_all_gb": sent / 1e9, "all_to_all_ms": sent / (H100["nvlink_gbps_each_way"] * 1e9) * 1e3})
    return rows


# ---- the report ------------------------------------------------------------------------------------


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f} {'ok' if value <= TARGET else 'ABOVE'}"


def markdown(result: dict) -> str:
    lines = ["# Ulysses sequence parallelism: memory per rank, step time, all-to-all bytes (CPU)", "",
             f"Command: `{result['command']}`", "", harness.describe(result["environment"]), "",
             "One packed row (one sequence: 256 prompt tokens, the rest completion), a 4-layer model of SmolLM2-135M's "
             "width (9 query heads, 3 KV heads), float32, the train step's forward + backward (dapo). Memory: each "
             "rank's peak RSS in the step over its RSS at the start (parameters and gradients already there), as "
             "measured / the part that grows with the row (over the step on the base row of 768 tokens, whose extra memory "
             "is the fixed column: the lm_head's and the embedding's [V, H] gradients and the loss's full logit slabs, "
             "at any N; the module docstring says why not a shorter one). "
             "N=1: today's trainer path (under checkpointing: the dense block mask); N=1 sp: the sequence-parallel "
             "path on a group of 1 (per-sequence SDPA under checkpointing too); N=3: the largest of the 3 ranks. "
             "Target: N=3's growing part <= 1.1 x (N=1 sp's / 3). The same with torch's own tensor bytes (the "
             "profiler's running sum of allocations minus frees, peak over the step: no C allocator caching or "
             "fragmentation in it), and the tensor bytes the forward leaves for the backward (held: activations saved "
             "or checkpointed and the loss's saved tensors, without the backward's transients; the profiler also counts "
             "what gloo's threads allocate meanwhile), and the storages of the tensors created in the forward that "
             "Python still holds (gc: under checkpointing, all the forward keeps: the layers' checkpointed inputs). "
             "Times: 3 ranks share 2 cores.", "",
             *([f"Rows with checkpointing rerun since: `{result['rerun']}`.", ""] if "rerun" in result else []),
             "| checkpointing | tokens | RSS MB N=1 | RSS MB N=1 sp | RSS MB N=3 a rank | RSS fixed MB N=1 / sp / N=3 "
             "| RSS: N=3 / (N=1 sp / 3), growing part | RSS: N=3 / (N=1 / 3), growing part "
             "| tensors MB, growing part: N=1 sp / N=3 a rank | tensors: N=3 / (N=1 sp / 3) "
             "| held MB, growing part: N=1 sp / N=3 a rank | held: N=3 / (N=1 sp / 3) "
             "| held, Python's tensors: N=3 / (N=1 sp / 3) "
             "| step s N=1 / N=1 sp / N=3 | all-to-all bytes a rank (formula) |", "|" + " --- |" * 15]
    for s in result["summary"]:
        mb, t, g, f, tg, hg = s["mb"], s["step_s"], s["grows_mb"], s["fixed_mb"], s["tensor_grows_mb"], s["held_grows_mb"]
        lines.append(f"| {'on' if s['checkpointing'] else 'off'} | {s['tokens']} | {mb['N=1']:.0f} / {g['N=1']:.0f} "
                     f"| {mb['N=1 sp']:.0f} / {g['N=1 sp']:.0f} | {mb['N=3']:.0f} / {g['N=3']:.0f} "
                     f"| {f['N=1']:.0f} / {f['N=1 sp']:.0f} / {f['N=3']:.0f} "
                     f"| {_ratio(s['ratio_vs_sp'])} "
                     f"| {s['ratio_vs_today']:.2f} | {tg['N=1 sp']:.0f} / {tg['N=3']:.0f} "
                     f"| {_ratio(s['tensor_ratio_vs_sp'])} "
                     f"| {hg['N=1 sp']:.1f} / {hg['N=3']:.1f} "
                     f"| {_ratio(s['held_ratio_vs_sp'])} "
                     f"| {_ratio(s['held_python_ratio_vs_sp'])} "
                     f"| {t['N=1']:.1f} / {t['N=1 sp']:.1f} / {t['N=3']:.1f} "
                     f"| {s['bytes_measured'][0]} ({s['bytes_formula']}{', equal' if s['bytes_equal'] else ', DIFFER'}) |")
    lines += ["", "## A 7B model on 8 x H100 (computed, not measured)", "",
              f"{project.__doc__.split(chr(10), 1)[1].strip()}", "",
              "| tokens a row | N | tokens per GPU | model states GB | GB per GPU, no checkpointing | GB per GPU, "
              "checkpointing | all-to-all GB per GPU a step (checkpointing) | all-to-all ms at 450 GB/s |",
              "|" + " --- |" * 8]
    for r in result["projection"]:
        lines.append(f"| {r['tokens']} | {r['n']} | {r['tokens_per_gpu']} | {r['states_gb']:.1f} | "
                     f"{r['gb_without_checkpointing']:.1f}{' (> 80)' if r['gb_without_checkpointing'] > 80 else ''} | "
                     f"{r['gb_with_checkpointing']:.1f} | {r['all_to_all_gb']:.1f} | {r['all_to_all_ms']:.0f} |")
    v = result["verl"]
    lines += ["", f"verl's figure beside it ({v['source']}): {v['model']} with ulysses_sequence_parallel_size="
              f"{v['sp']}, {v['tokens_per_gpu']} tokens per GPU ({v['tokens_per_group']} a group of {v['sp']}), "
              "gradient checkpointing and FSDP offload of parameters and optimizer; verl states no memory figure. The "
              "rows above at N = 4 put 8192 (32k) and 16384 (64k) tokens on a GPU, below verl's 20480, within 80 GB "
              "with checkpointing and without offload."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--project", action="store_true", help="the 7B projection alone")
    parser.add_argument("--only-checkpointing", action="store_true",
                        help="rerun the rows with checkpointing, keep the saved rows without it")
    parser.add_argument("--report", action="store_true", help="rewrite the report from the saved json (no runs)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.lengths, args.checkpointing)
    result = {"command": harness.command_line("benchmarks/bench_sequence_parallel.py"),
              "environment": harness.environment(), "projection": project(), "verl": VERL}
    if args.project:
        print(json.dumps(result["projection"], indent=1))
        return
    if args.report:
        saved = json.loads(OUT.with_suffix(".json").read_text())
        result = {**saved, "projection": project(), "verl": VERL, "summary": summary(saved["rows"])}
        harness.write_results(OUT, result, markdown(result))
        print(markdown(result))
        return
    if args.only_checkpointing:  # (the other half as saved)
        saved = json.loads(OUT.with_suffix(".json").read_text())
        result["rows"] = [r for r in saved["rows"] if not r["checkpointing"]] + sweep(args.lengths, (True,))
        result["rerun"] = harness.command_line("benchmarks/bench_sequence_parallel.py")
    else:
        result["rows"] = sweep(args.lengths)
    result["summary"] = summary(result["rows"])
    harness.write_results(OUT, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

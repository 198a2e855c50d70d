"""FastGRPOTrainer against stock trl.GRPOTrainer: time and peak memory of the parts that differ.

    python benchmarks/bench_trl.py                  # CPU preset, writes benchmarks/results/trl_cpu.{md,json}
    python benchmarks/bench_trl.py --cases long-onpolicy --repeats 2 --out /tmp/trl_bench

Both trainers are built on the same random Llama with a large vocabulary (so the lm_head and its
logits dominate, as in long-completion RL) and get the same synthetic batch: random prompt and
completion ids, every completion token active, seeded advantages. Generation is left out on
purpose: it is TRL's in both trainers, identical, and on the CPU it would dominate the wall time.
Measured, each trainer in its own subprocess so the peak is its own:

  logprob pass   `_get_per_token_logps_and_entropies` under no_grad (the old-policy / reference
                 passes of a step), over the whole batch
  loss step      `compute_loss` + `backward` (what one micro-step of training runs)

Time: best and median of `--repeats` runs after one warm-up (the CPU is shared with other jobs:
the best run is the least disturbed). Memory: peak RSS over the RSS just before the runs
(the peak is reset through /proc/self/clear_refs before each measured part); it includes the
gradients every implementation must produce.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout works too

# name: (batch, prompt length, completion length, vocab, hidden, layers, num_iterations, beta, gradient checkpointing)
CASES = {
    "short-onpolicy": (8, 32, 128, 32768, 256, 2, 1, 0.0, False),
    "long-onpolicy": (2, 32, 2048, 50304, 256, 2, 1, 0.0, False),
    "long-iter2-kl": (2, 32, 2048, 50304, 256, 2, 2, 0.04, False),
}
# a group of 2 long completions on a small long-context model with SmolLM2's vocabulary (bench_long.py --memory)
MEMORY_LENGTHS = (1024, 2048, 4096, 8192)
for _T in MEMORY_LENGTHS:
    CASES[f"mem-{_T // 1024}k"] = (2, 64, _T, 49152, 256, 4, 1, 0.0, False)
    CASES[f"mem-{_T // 1024}k-gc"] = (2, 64, _T, 49152, 256, 4, 1, 0.0, True)
SHAPE_FIELDS = ("batch", "prompt", "completion", "vocab", "hidden", "layers", "num_iterations", "beta",
                "gradient_checkpointing")
TRAINERS = ("trl", "fast")


# ----------------------------------------------------------------------------------------------
# Worker: one trainer, one case
# ----------------------------------------------------------------------------------------------


def _measure(fn, repeats: int) -> dict:
    """Best/median seconds of fn() after one warm-up, and its peak RSS (MiB) over the RSS before
    (the largest over the repeats)."""
    fn()
    timing, extra = harness.Timing(), 0
    for _ in range(repeats):
        harness.release_memory()
        with harness.PeakMemory("cpu", reset_rss_peak=True) as memory:
            timing.times_s.append(harness.time_call(fn))
        extra = max(extra, memory.extra_bytes)
    return {"best_s": timing.best_s, "median_s": timing.median_s, "peak_extra_mib": extra / 2**20}


def _build_trainer(trainer: str, case: str, workdir: str):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tests.tiny_model import build_tiny_model

    B, P, T, V, H, L, iterations, beta, checkpointing = CASES[case]
    path = build_tiny_model(os.path.join(workdir, "model"), vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                            num_hidden_layers=L, num_attention_heads=H // 64, num_key_value_heads=H // 64,
                            max_position_embeddings=max(2048, P + T))
    args = GRPOConfig(output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=T, num_iterations=iterations, beta=beta, use_cpu=True, bf16=False,
                      report_to=[], save_strategy="no", gradient_checkpointing=checkpointing)
    cls = GRPOTrainer
    if trainer == "fast":
        from grpo_fast.integrations.trl import FastGRPOTrainer as cls
    dataset = Dataset.from_dict({"prompt": ["x"] * B})
    out = cls(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
              train_dataset=dataset)
    out.model.train()
    out.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    return out


def _synthetic_batch(case: str):
    import torch

    B, P, T, V, *_ = CASES[case]
    gen = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(3, V, (B, P), generator=gen),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, V, (B, T), generator=gen),
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "advantages": torch.randn(B, generator=gen),
        "num_items_in_batch": torch.tensor(float(B * T)),
    }


def worker(trainer: str, case: str, repeats: int) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as workdir:
        t = _build_trainer(trainer, case, workdir)
        inputs = _synthetic_batch(case)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        T = inputs["completion_ids"].size(1)

        def logprob_pass():
            with torch.no_grad():
                return t._get_per_token_logps_and_entropies(t.model, ids, att, T, batch_size=ids.size(0))[0]

        result = {"logprob_pass": _measure(logprob_pass, repeats)}
        if t.num_iterations > 1:
            inputs["old_per_token_logps"] = logprob_pass()
        if t.beta != 0.0:
            with torch.no_grad():
                inputs["ref_per_token_logps"] = t._get_per_token_logps_and_entropies(t.ref_model, ids, att, T)[0]

        losses = []

        def loss_step():
            t.model.zero_grad(set_to_none=True)
            loss = t.compute_loss(t.model, inputs)
            loss.backward()
            losses.append(loss.item())

        result["loss_step"] = _measure(loss_step, repeats)
        result["loss"] = losses[-1]
        result["tokens"] = int(inputs["completion_mask"].sum())
        result["threads"] = torch.get_num_threads()
    return result


# ----------------------------------------------------------------------------------------------
# Driver: every (case, trainer) in its own subprocess, then the tables
# ----------------------------------------------------------------------------------------------


def run_all(cases, repeats: int, keep_going: bool = False) -> list[dict]:
    """One worker process per (case, trainer). keep_going: a worker that fails (killed for memory,
    say) becomes a row with its error, and the sweep goes on."""
    rows = []
    for case in cases:
        for trainer in TRAINERS:
            cmd = [sys.executable, __file__, "--worker", trainer, "--cases", case, "--repeats", str(repeats)]
            print(f"[bench_trl] {case} {trainer} ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                if not keep_going:
                    raise RuntimeError(f"worker {trainer}/{case} failed:\n{proc.stderr[-4000:]}")
                why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][-200:]
                if proc.returncode < 0:
                    why = f"killed by signal {-proc.returncode} (out of memory?)"
                rows.append({"case": case, "trainer": trainer, "shape": dict(zip(SHAPE_FIELDS, CASES[case], strict=True)),
                             "error": why})
                print(f"[bench_trl]   failed: {why}", flush=True)
                continue
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"case": case, "trainer": trainer, "shape": dict(zip(SHAPE_FIELDS, CASES[case], strict=True)), **result})
            print(f"[bench_trl]   {json.dumps(result)}", flush=True)
    return rows


def markdown(rows, command: str, env: dict) -> str:
    lines = [
        "# FastGRPOTrainer vs trl.GRPOTrainer (CPU)", "",
        f"`{command}` on {harness.describe(env)}, load average {env['load_average']} (shared with other jobs: "
        "times are noisy; the best of the repeats is the least disturbed run). TRL "
        f"{harness.package_version('trl')}, transformers {harness.package_version('transformers')}. fp32.", "",
        "Loss step = `compute_loss` + `backward` on one micro-batch; logprob pass = the no-grad old/ref pass. "
        "Peak = peak RSS above the RSS before the part (includes the gradients).", "",
        "| case | B x T (completion) | V | trainer | loss step best / median s | loss step peak MiB "
        "| logprob pass best s | logprob pass peak MiB | loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['shape']['batch']} x {r['shape']['completion']} | {r['shape']['vocab']} "
                         f"| {r['trainer']} | failed: {r['error']} | | | | |")
            continue
        s, lp = r["loss_step"], r["logprob_pass"]
        lines.append(
            f"| {r['case']} | {r['shape']['batch']} x {r['shape']['completion']} | {r['shape']['vocab']} | {r['trainer']} "
            f"| {s['best_s']:.2f} / {s['median_s']:.2f} | {s['peak_extra_mib']:.0f} | {lp['best_s']:.2f} "
            f"| {lp['peak_extra_mib']:.0f} | {r['loss']:.6g} |"
        )
    lines += ["", "Ratios (trl / fast):", ""]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["trainer"]] = r
    for case, pair in by_case.items():
        if set(pair) == set(TRAINERS) and not any("error" in r for r in pair.values()):
            a, b = pair["trl"], pair["fast"]
            lines.append(
                f"- {case}: loss step time x{a['loss_step']['best_s'] / b['loss_step']['best_s']:.2f}, "
                f"peak memory x{a['loss_step']['peak_extra_mib'] / max(b['loss_step']['peak_extra_mib'], 1):.1f}; "
                f"logprob pass time x{a['logprob_pass']['best_s'] / b['logprob_pass']['best_s']:.2f}, "
                f"peak x{a['logprob_pass']['peak_extra_mib'] / max(b['logprob_pass']['peak_extra_mib'], 1):.1f}"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trl_cpu"),
                        help="output path without extension: writes .md and .json")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; expected some of {list(CASES)}")
    if args.worker:
        print(json.dumps(worker(args.worker, cases[0], args.repeats)))
        return
    command, env = harness.command_line(__file__, argv), harness.environment()
    rows = run_all(cases, args.repeats)
    harness.write_results(Path(args.out), {"command": command, "environment": env, "rows": rows},
                          markdown(rows, command, env))
    print(markdown(rows, command, env))


if __name__ == "__main__":
    main()

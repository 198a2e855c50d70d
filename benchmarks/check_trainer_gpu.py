"""The trainer end to end on a GPU (gpu_suite.sh stage "trainer"): a few GRPO steps of `GRPOTrainer`
with the HF engine on a tiny Llama built on the device, beta > 0 and num_iterations = 2, packed
micro-batches with per-sequence attention; and the packed log-probs against a padded forward.

    python benchmarks/check_trainer_gpu.py --out DIR                          # on the GPU
    python benchmarks/check_trainer_gpu.py --out DIR --device cpu --dtype float32   # a dry run on a CPU

Cases, each `--steps` optimizer steps:
  weights    the model's weights in --dtype (bfloat16 on the GPU)
  amp        float32 weights, mixed_precision=bf16 (the decoder under autocast)
  fsdp2      --dtype weights under torchrun with one rank and distributed_strategy=fsdp2 (NCCL on CUDA)
  lora       --dtype weights, a LoRA adapter (use_peft, r 8, all-linear; the reference: the adapter disabled)
  qlora      the same on a 4-bit base (load_in_4bit: bitsandbytes on CUDA; skipped, and said so, elsewhere)
  multi_turn agents: the tiny model made to call tools (tests/agents/tool_model.py), its add / mul tools over
             several turns with the HF engine on the device, tool tokens masked (tools/call_frequency, turns)
  reward_model  a tiny sequence-classification reward model (its scores the reward), placed on the device
Each reports whether the steps ran with finite losses, and the peak memory of each step (CUDA's
allocator; None on a CPU); the LoRA cases also whether every base tensor is bitwise unchanged. packed_vs_padded: the trainer's packed log-probs (its own attention path:
varlen flash-attn if installed, else per-sequence SDPA) against a right-padded forward with
materialised logits, in float32 and in bf16, against a float32 padded reference: bf16 passes when
its error is at most 2x the error the padded bf16 forward itself makes (plain PyTorch's).
Writes DIR/check_trainer.json and DIR/check_trainer.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout, not installed


def _steps(trainer, output_dir: str, steps: int, **extra) -> dict:
    """What every case reports of its logged steps: how many, finite, loss and grad-norm per step."""
    logged = [json.loads(x) for x in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in logged if "loss" in x]
    return dict(steps=trainer.state.step, strategy=trainer.parallel.strategy, **extra,
                finite=len(logged) == steps and all(math.isfinite(x["loss"]) for x in logged),
                loss=[x["loss"] for x in logged], grad_norm=[x["grad_norm"] for x in logged], logged=logged)


def train_case(model_dir: str, device: str, dtype: str, steps: int, **overrides) -> dict:
    """A few GRPO steps in this process; per step: loss, kl, grad_norm and the peak memory."""
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    with tempfile.TemporaryDirectory() as out:
        c = config(Path(out), model=model_dir, dtype=dtype, beta=0.05, num_iterations=2, max_steps=steps,
                   per_device_train_batch_size=8, max_completion_length=16, learning_rate=1e-3, eval_before_train=False,
                   eval_steps=0, save_final=False, **overrides)
        trainer = GRPOTrainer(c, [target_fraction], rows(), rows(4))
        peaks, real_step = [], trainer._optimizer_step

        def optimizer_step(*args, **kwargs):  # the peak of each optimizer step (forward, loss, backward, update)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            metrics = real_step(*args, **kwargs)
            peaks.append(torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None)
            return metrics

        trainer._optimizer_step = optimizer_step
        lora = c.use_peft
        base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad} if lora else {}
        trainer.train()
        extra = {}
        if lora:  # only the adapter trains: every frozen (base) tensor bitwise as loaded
            now = dict(trainer.model.named_parameters())
            extra = dict(base_unchanged=all(torch.equal(now[n], t) for n, t in base.items()),
                         trainable=sum(p.numel() for p in now.values() if p.requires_grad))
        out = _steps(trainer, c.output_dir, steps, **extra)
    return dict(out, kl=[x.get("kl") for x in out.pop("logged")], peak_mib=peaks)


def multi_turn_case(device: str, dtype: str, steps: int) -> dict:
    """GRPO steps of the tiny tool-calling model with its tools (rollout_mode multi_turn, HF engine)."""
    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer
    from tests.agents.tool_model import TOOL_NAMES, build_tool_model, right_answer, tool_prompts

    with tempfile.TemporaryDirectory() as out:
        model_dir = build_tool_model(Path(out) / "model")
        c = GRPOConfig(model=model_dir, tools=TOOL_NAMES, reward_funcs=["right_answer"], num_generations=4, dtype=dtype,
                       per_device_train_batch_size=8, max_prompt_length=64, max_completion_length=200, max_steps=steps,
                       learning_rate=1e-4, engine="hf", output_dir=str(Path(out) / "run"), disable_tqdm=True,
                       eval_steps=0, eval_before_train=False, save_final=False)
        trainer = GRPOTrainer(c, [right_answer], tool_prompts(24))
        trainer.train()
        out = _steps(trainer, c.output_dir, steps, on_device=str(next(trainer.model.parameters()).device))
    logged = out.pop("logged")
    return dict(out, tool_calls=[x["tools/call_frequency"] for x in logged], turns=[x["tools/turns_mean"] for x in logged])


def reward_model_case(model_dir: str, device: str, dtype: str, steps: int) -> dict:
    """GRPO steps rewarded by a tiny reward model (a sequence-classification folder in reward_funcs)."""
    from transformers import LlamaForSequenceClassification

    from grpo_fast.rewards import get_reward_funcs
    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_model import build_tiny_tokenizer, tiny_llama_config
    from tests.trainer.common import config, rows

    with tempfile.TemporaryDirectory() as out:
        folder = Path(out) / "tiny-rm"
        torch.manual_seed(0)
        LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).float().save_pretrained(folder)
        build_tiny_tokenizer().save_pretrained(folder)
        (rm,) = get_reward_funcs([str(folder)])
        c = config(Path(out), model=model_dir, dtype=dtype, max_steps=steps, per_device_train_batch_size=8,
                   max_completion_length=16, learning_rate=1e-3, eval_before_train=False, eval_steps=0, save_final=False,
                   reward_funcs=["tiny-rm"])
        trainer = GRPOTrainer(c, [rm], rows())
        trainer.train()
        out = _steps(trainer, c.output_dir, steps, reward_model_device=str(rm.model.device))
    return dict(out, reward=[x["reward"] for x in out.pop("logged")])


def fsdp2_case(model_dir: str, device: str, dtype: str, steps: int) -> dict:
    """The same steps under torchrun, one rank, distributed_strategy=fsdp2 (a child process)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__,
               "--child", result.name, "--model", model_dir, "--device", device, "--dtype", dtype, "--steps", str(steps)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if done.returncode != 0:
            return dict(finite=False, error=done.stderr[-3000:])
        return json.loads(Path(result.name).read_text())


def packed_vs_padded(model_dir: str, device: str) -> dict:
    """Max |packed - reference| of completion log-probs, float32 and bf16, with the padded bf16's own error."""
    from grpo_fast.train.forward import Packer, completion_logprobs
    from tests.tiny_model import load_tiny_model
    from tests.trainer.test_packing import _padded_reference_logprobs

    g = torch.Generator().manual_seed(0)
    lengths = [(5, 9), (11, 3), (2, 14), (7, 7)]
    prompts = [torch.randint(3, 300, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(3, 300, (c,), generator=g).tolist() for _, c in lengths]
    model = load_tiny_model(model_dir)[0].to(device).eval()
    reference = _padded_reference_logprobs(model, prompts, completions, temperature=1.0)
    worst = lambda got: max(float((a.double().cpu() - b.cpu()).abs().max()) for a, b in zip(got, reference, strict=True))
    out = {"scale": max(float(r.abs().max()) for r in reference)}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = model.to(dtype)
        packed = completion_logprobs(m, Packer(m, max_tokens=64), prompts, completions, temperature=1.0, backend="auto")
        out[f"packed_{name}"] = worst(packed)
        out[f"padded_{name}"] = worst(_padded_reference_logprobs(m, prompts, completions, temperature=1.0))
    out["ok"] = (out["packed_float32"] <= 1e-3 * out["scale"]
                 and out["packed_bfloat16"] <= 2 * out["padded_bfloat16"] + 1e-3 * out["scale"])
    return out


def markdown(report: dict) -> str:
    lines = [f"# The trainer on {report['device']} ({report['dtype']} weights)", "",
             f"Command: `{report['command']}`", "",
             "| case | strategy | steps | finite losses | loss per step | peak MiB per step |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in report["cases"].items():
        loss = ", ".join(f"{x:.4g}" for x in r.get("loss", []))
        peak = ", ".join("-" if x is None else f"{x:.0f}" for x in r.get("peak_mib", []))
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        finite = f"{r['finite']}" + ("" if "base_unchanged" not in r else f" (base unchanged: {r['base_unchanged']})")
        lines.append(f"| {name} | {r.get('strategy', '-')} | {r.get('steps', 0)} | {finite} | {loss} | {peak} |")
    if "tool_calls" in report["cases"].get("multi_turn", {}):
        r = report["cases"]["multi_turn"]
        lines += ["", f"multi_turn (model on {r['on_device']}): tools/call_frequency per step "
                      f"{', '.join(f'{x:.2f}' for x in r['tool_calls'])}; tools/turns_mean "
                      f"{', '.join(f'{x:.2f}' for x in r['turns'])}"]
    if "reward" in report["cases"].get("reward_model", {}):
        r = report["cases"]["reward_model"]
        lines += ["", f"reward_model (on {r['reward_model_device']}): reward per step "
                      f"{', '.join(f'{x:.4g}' for x in r['reward'])}"]
    p = report["packed_vs_padded"]
    lines += ["", f"Packed vs padded log-probs (max |diff| against a float32 padded reference, scale {p['scale']:.3g}): "
              f"packed float32 {p['packed_float32']:.2e}, packed bf16 {p['packed_bfloat16']:.2e} (padded bf16 "
              f"{p['padded_bfloat16']:.2e}): {'ok' if p['ok'] else 'FAILED'}"]
    for name, r in report["cases"].items():
        if "error" in r:
            lines += ["", f"{name} failed:", "```", r["error"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="weights' dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", help=argparse.SUPPRESS)  # the child's: the folder the parent built
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the child's: where it writes its result
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.child:  # under torchrun: the fsdp2 case
        result = train_case(args.model, args.device, dtype, args.steps, distributed_strategy="fsdp2")
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.child).write_text(json.dumps(result))
        return 0
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp))
        lora = dict(use_peft=True, lora_r=8, lora_alpha=16)
        cases = {"weights": train_case(model_dir, args.device, dtype, args.steps),
                 "amp": train_case(model_dir, args.device, "float32", args.steps, mixed_precision="bf16"),
                 "fsdp2": fsdp2_case(model_dir, args.device, dtype, args.steps),
                 "lora": train_case(model_dir, args.device, dtype, args.steps, **lora)}
        if args.device == "cuda" and importlib.util.find_spec("bitsandbytes") is not None:
            try:
                cases["qlora"] = train_case(model_dir, args.device, dtype, args.steps, load_in_4bit=True, **lora)
            except Exception as err:  # (reported, not raised: the other cases' figures still come back)
                cases["qlora"] = dict(finite=False, error=f"{type(err).__name__}: {err}"[-3000:])
        else:
            cases["qlora"] = dict(skipped="needs bitsandbytes on a CUDA GPU", finite=True)
        for name, case in (("multi_turn", lambda: multi_turn_case(args.device, dtype, args.steps)),
                           ("reward_model", lambda: reward_model_case(model_dir, args.device, dtype, args.steps))):
            try:  # (reported, not raised: the other cases' figures still come back)
                cases[name] = case()
            except Exception as err:
                cases[name] = dict(finite=False, error=f"{type(err).__name__}: {err}"[-3000:])
        report = dict(device=args.device, dtype=dtype, command=" ".join(["python", *sys.argv]), cases=cases,
                      packed_vs_padded=packed_vs_padded(model_dir, args.device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_trainer.json").write_text(json.dumps(report, indent=2))
    (out / "check_trainer.md").write_text(markdown(report))
    print(markdown(report))
    ok = all(r["finite"] and r.get("steps") == args.steps and r.get("base_unchanged", True)
             for r in cases.values() if "skipped" not in r) and report["packed_vs_padded"]["ok"]
    ok = ok and any(x > 0 for x in cases["multi_turn"].get("tool_calls", []))  # (the tools ran)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

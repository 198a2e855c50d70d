"""A tiny mixture-of-experts model's GRPO step on a device (a stage for gpu_suite.sh): the fused path with the router
load-balancing loss against the model's own forward, then its time and peak memory. Inputs are built directly (random
prompt and completion ids): no tokenizer, no download.

    python benchmarks/check_moe_step.py --out DIR                                  # on the GPU
    python benchmarks/check_moe_step.py --out DIR --device cpu --dtype float32     # a dry run on a CPU

equality (float32 weights, TF32 off): a random Qwen3-MoE (4 experts, top-2) from its config; one fused-loss forward +
  backward (`train_step`: packed micro-batches, the decoder with output_router_logits, the fused lm_head op, the
  Switch loss of grpo_fast.models.moe / objective.load_balancing_loss, weighted by --coef) against the model's own
  forward: each sequence's materialised logits under the spec's loss (objective.grpo_loss_reference) plus coef x the
  mean over the micro-batches of the model's own `aux_loss` on their sequences, padded. Loss, aux loss and every
  gradient compared (|diff| / max(1, |expected|)).
step (--dtype weights, --preset's model): the same fused step, time (best of --repeats after a warm-up) and the
  step's extra peak memory (torch.cuda.max_memory_allocated on a GPU, VmHWM on a CPU).
Writes DIR/check_moe_step.json and DIR/check_moe_step.md. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout, not installed
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

# model and batch presets: (hidden, layers, experts, vocab, sequences, sequence length, packed row budget)
PRESETS = {
    "check": dict(hidden=32, layers=2, experts=4, vocab=320, sequences=3, length=12, max_tokens=12),
    "bench": dict(hidden=256, layers=4, experts=8, vocab=32768, sequences=16, length=256, max_tokens=2048),
}


def qwen3_moe(preset: str, seed: int = 0):
    """A random Qwen3-MoE of the preset (float32, train mode, on the CPU): top-2 routing, its router loss declared."""
    import transformers

    p = PRESETS[preset]
    config = transformers.Qwen3MoeConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=2 * p["hidden"], num_hidden_layers=p["layers"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=p["hidden"] // 2, max_position_embeddings=4096,
        num_experts=p["experts"], num_experts_per_tok=2, moe_intermediate_size=p["hidden"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
    return model.train()


def batch(preset: str, seed: int = 0):
    """Rollouts of the preset's sequences (prompt + completion = length + 1 tokens, the prompt 2 .. length - 1)."""
    from grpo_fast.generation.batch import Rollouts

    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(p["sequences"]):
        n = p["length"] - int(torch.randint(0, 3, (1,), generator=g))
        cut = int(torch.randint(2, n - 1, (1,), generator=g))
        prompts.append(torch.randint(3, p["vocab"], (cut,), generator=g).tolist())
        completions.append(torch.randint(3, p["vocab"], (n + 1 - cut,), generator=g).tolist())
    k = len(prompts)
    out = Rollouts(prompts, completions, [torch.zeros(len(c)) for c in completions], ["stop"] * k, [""] * k, [{}] * k)
    out.advantages = torch.randn(k, generator=g)
    return out


class Grads:
    """An optimizer stand-in: keeps (or drops) the gradients train_step hands it."""

    def __init__(self, model, keep: bool = True):
        self.model, self.keep, self.grads = model, keep, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        if self.keep:
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def loss_options():
    from grpo_fast.objective import LossOptions

    return LossOptions(loss_type="dapo", beta=0.0, temperature=0.9, backend="auto")


def fused_step(model, data, max_tokens: int, coef: float, keep_grads: bool = False):
    """train_step's metrics, the gradients (keep_grads) and the micro-batches' sample indices."""
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.step import train_step

    optimizer = Grads(model, keep=keep_grads)
    packer = Packer(model, max_tokens=max_tokens)
    groups = [mb.rows for mb in packer.micro_batches(data.prompt_ids, data.completion_ids)]
    metrics = train_step(model, optimizer, packer, data, loss_options(), max_grad_norm=0.0, router_aux_loss_coef=coef)
    return metrics, optimizer.grads, groups


def reference(model, data, groups, coef: float, device: str):
    """(loss, aux loss, grads): the spec's loss on each sequence's own materialised logits + coef x the mean over the
    micro-batches of the model's own aux_loss on their sequences (prompt + completion but its last token), padded."""
    from grpo_fast import objective

    vocab = model.config.vocab_size
    model.zero_grad(set_to_none=True)
    seqs = [p + c[:-1] for p, c in zip(data.prompt_ids, data.completion_ids, strict=True)]
    width = max(len(c) for c in data.completion_ids)
    rows = []
    target = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (p, c) in enumerate(zip(data.prompt_ids, data.completion_ids, strict=True)):
        logits = model(input_ids=torch.tensor([seqs[i]], device=device)).logits[0]
        rows.append(torch.cat([logits[len(p) - 1:], logits.new_zeros(width - len(c), vocab)]))
        target[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1.0
    loss, _ = objective.grpo_loss_reference(torch.stack(rows), target.to(device), data.advantages.to(device),
                                            mask.to(device), loss_options())
    auxes = []
    for group in groups:
        longest = max(len(seqs[i]) for i in group)
        ids = torch.tensor([seqs[i] + [0] * (longest - len(seqs[i])) for i in group], device=device)
        attention = torch.tensor([[1] * len(seqs[i]) + [0] * (longest - len(seqs[i])) for i in group], device=device)
        auxes.append(model(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss)
    aux = torch.stack(auxes).mean()
    total = loss + coef * aux
    total.backward()
    return float(total.detach()), float(aux.detach()), {n: q.grad.clone() for n, q in model.named_parameters()
                                                        if q.grad is not None}


def equality(device: str, coef: float) -> dict:
    model = qwen3_moe("check").to(device)
    data = batch("check")
    metrics, grads, groups = fused_step(model, data, PRESETS["check"]["max_tokens"], coef, keep_grads=True)
    loss, aux, expected = reference(model, data, groups, coef, device)

    def rel(a, b):  # |a - b| / max(1, |b|): the magnitude-scaled error the tests bound
        return float((a.double() - b.double()).abs().max()) / max(1.0, float(b.double().abs().max()))

    routers = [n for n in expected if n.endswith("mlp.gate.weight")]
    out = {"loss_err": abs(metrics["loss"] - loss) / max(1.0, abs(loss)),
           "aux_err": abs(metrics["aux_loss"] - aux) / max(1.0, abs(aux)), "aux_loss": aux,
           "grad_err": max(rel(grads[n], g) for n, g in expected.items()),
           "same_grads": grads.keys() == expected.keys(), "router_grads": len(routers),
           "micro_batches": metrics["num_micro_batches"], "max_expert_load": metrics["moe/max_expert_load"]}
    out["ok"] = (out["loss_err"] < 1e-4 and out["aux_err"] < 1e-4 and out["grad_err"] < 1e-3 and out["same_grads"]
                 and out["router_grads"] == PRESETS["check"]["layers"])
    return out


def step_cost(device: str, dtype: str, preset: str, repeats: int, coef: float) -> dict:
    """Time and extra peak memory of one fused step (forward + backward, the router loss on)."""
    import time

    model = qwen3_moe(preset).to(device, getattr(torch, dtype))
    data = batch(preset, seed=1)
    run = lambda: fused_step(model, data, PRESETS[preset]["max_tokens"], coef)[0]  # noqa: E731
    run()  # warm-up (the Triton compile)
    timing, peak, metrics, cpu = harness.Timing(), 0, {}, []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        harness.release_memory()
        with harness.PeakMemory(device, reset_rss_peak=True) as memory:
            start = time.process_time()
            timing.times_s.append(harness.time_call(lambda: metrics.update(run()), device))
            cpu.append(time.process_time() - start)
        peak = max(peak, memory.extra_bytes)
    p = PRESETS[preset]
    return {"best_s": timing.best_s, "median_s": timing.median_s, "cpu_s": min(cpu), "peak_extra_mib": peak / 2**20,
            "loss": metrics["loss"], "aux_loss": metrics["aux_loss"], "max_expert_load": metrics["moe/max_expert_load"],
            "micro_batches": metrics["num_micro_batches"], "tokens": sum(len(a) + len(b) - 1 for a, b in
                                                                          zip(data.prompt_ids, data.completion_ids, strict=True)),
            "shape": {**p, "dtype": dtype, "coef": coef}}


def markdown(result: dict) -> str:
    eq, s = result["equality"], result["step"]
    return "\n".join([
        "# A tiny MoE's GRPO step (check_moe_step.py)", "", f"`{result['command']}` on "
        f"{harness.describe(result['environment'])}.", "",
        f"Equality (Qwen3-MoE, float32, router loss coef {result['coef']}): loss {eq['loss_err']:.2g}, aux loss "
        f"{eq['aux_err']:.2g}, gradients {eq['grad_err']:.2g} (max |diff| / max(1, |expected|)), {eq['router_grads']} "
        f"router gradients, {eq['micro_batches']} micro-batches -> {'ok' if eq['ok'] else 'FAILED'}", "",
        f"Step: {json.dumps(s['shape'])}, {s['tokens']} tokens in {s['micro_batches']} micro-batches", "",
        "| best s | median s | CPU s | peak MiB | loss | aux loss | max expert load |", "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['best_s']:.4f} | {s['median_s']:.4f} | {s['cpu_s']:.2f} | {s['peak_extra_mib']:.0f} | {s['loss']:.6g} "
        f"| {s['aux_loss']:.6g} | {s['max_expert_load']:.3g} |", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for check_moe_step.json and .md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                        help="the weights' dtype in the step timing (the equality check is float32)")
    parser.add_argument("--preset", default="bench", choices=list(PRESETS), help="the timed step's model and batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coef", type=float, default=0.5, help="router loss weight (large: a dropped loss fails)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats: expected at least 1, got {args.repeats}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {"command": harness.command_line(__file__, argv), "environment": harness.environment(), "coef": args.coef}
    result["equality"] = equality(args.device, args.coef)
    print("equality", json.dumps(result["equality"]), flush=True)
    result["step"] = step_cost(args.device, args.dtype, args.preset, args.repeats, args.coef)
    print("step", json.dumps(result["step"]), flush=True)
    result["ok"] = result["equality"]["ok"] and math.isfinite(result["step"]["loss"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_results(out / "check_moe_step", result, markdown(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

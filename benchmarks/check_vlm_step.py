"""A tiny vision-language model's GRPO step on a device (a stage for gpu_suite.sh): the fused path against the
model's own forward, then its time and memory against the padded path. Inputs are built directly (random pixel
patches with their image_grid_thw, prompt ids with each image's placeholder expanded by grid.prod() / merge**2):
no PIL, no torchvision, no processor, no TRL needed.

    python benchmarks/check_vlm_step.py --out DIR                                  # on the GPU
    python benchmarks/check_vlm_step.py --out DIR --device cpu --dtype float32     # a dry run on a CPU

equality (float32 weights, TF32 off): a random Qwen2-VL (M-RoPE) with two groups of G = 4 completions (prompts with
  1 and 3 images) packed into one row, its image encoder trained: the fused path's per-token log-probs, loss and
  every gradient against the model's own forward with materialised logits, one sequence at a time; the encoder's
  calls in the step (= the prompts). Its merge: the backbone's own (mm_encoder_outputs) where transformers has it,
  else grpo_fast's inputs_embeds merge (said in the output).
step (--dtype weights, --preset's model): one training step (forward + backward, the encoder frozen as by default),
  time (best of --repeats after a warm-up) and peak memory, for
  fused   grpo_fast's train_step: packed rows, each prompt's images encoded once, the fused lm_head loss
  padded  the model's own forward over padded rows, each completion carrying its prompt's images (the image encoder
          runs once per completion), logits materialised, the spec's loss (what a trainer without a fused head does)
  trl     (where TRL is installed) TRL's own `_get_per_token_logps_and_entropies` on the padded rows, with TRL's
          fused lm head (`add_fused_lm_head`), in chunks of --trl-batch rows, the spec's loss
Writes DIR/check_vlm_step.json and DIR/check_vlm_step.md. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain checkout, not installed
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

IMAGE, VIDEO, VISION_START, VISION_END = 5, 6, 7, 8  # special ids of the synthetic vocabulary (0 pad, 1 bos, 2 eos)
PATCH, MERGE, TEMPORAL = 14, 2, 2
# model and batch presets: text (hidden, layers, heads, kv heads, vocab), vision (depth, width, heads),
# batch (prompts, images per prompt, image grid h x w in patches, G, prompt text tokens, completion tokens)
PRESETS = {
    "check": dict(hidden=64, layers=2, heads=2, kv_heads=1, vocab=512, depth=1, width=32, vision_heads=2,
                  prompts=(1, 3), grid=(4, 4), G=4, text=8, completion=6),
    "bench": dict(hidden=256, layers=4, heads=4, kv_heads=2, vocab=32768, depth=4, width=128, vision_heads=4,
                  prompts=(2, 2), grid=(16, 16), G=8, text=32, completion=128),
    # the largest that steps in seconds on 2 shared CPU cores (bench_vlm.py's default)
    "cpu": dict(hidden=256, layers=2, heads=4, kv_heads=2, vocab=16384, depth=4, width=128, vision_heads=4,
                prompts=(2, 2), grid=(16, 16), G=8, text=32, completion=64),
}


def qwen2_vl(preset: str, seed: int = 0):
    """A random Qwen2-VL of the preset (float32, train mode, on the CPU)."""
    import transformers

    p = PRESETS[preset]
    head_dim = p["hidden"] // p["heads"]
    third = head_dim // 2 // 4  # M-RoPE sections over head_dim / 2 frequencies: time 2/4, height 1/4, width 1/4
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=2 * p["hidden"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["kv_heads"], max_position_embeddings=4096, rms_norm_eps=1e-6,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2 * third, third, third]}),
        vision_config=dict(depth=p["depth"], embed_dim=p["width"], hidden_size=p["hidden"], num_heads=p["vision_heads"],
                           mlp_ratio=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                           in_channels=3, initializer_range=0.1),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config).float()
    return model.train()


def image_inputs(grids, generator) -> dict:
    """A prompt's image processor outputs, drawn directly: random patches, one row per patch of each image."""
    grid = torch.tensor([[1, h, w] for h, w in grids])
    patches = int(grid.prod(-1).sum())
    return {"pixel_values": torch.randn(patches, 3 * TEMPORAL * PATCH * PATCH, generator=generator),
            "image_grid_thw": grid}


def batch(preset: str, seed: int = 0):
    """A Rollouts of len(prompts) groups of G completions (prompt k with prompts[k] images of the preset's grid,
    one wider), advantages and old log-probs random; the group's entries share one image-inputs object."""
    from grpo_fast.generation.batch import Rollouts

    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    prompts, completions, images = [], [], []
    for n in p["prompts"]:
        grids = [(p["grid"][0], p["grid"][1] + 2 * (k % 2)) for k in range(n)]
        shared = image_inputs(grids, g)
        ids = torch.randint(9, p["vocab"], (p["text"] // 2,), generator=g).tolist()
        for h, w in grids:
            ids += [VISION_START, *[IMAGE] * (h * w // MERGE**2), VISION_END]
        ids += torch.randint(9, p["vocab"], (p["text"] - p["text"] // 2,), generator=g).tolist()
        for _ in range(p["G"]):
            prompts.append(ids)
            images.append(shared)
            length = p["completion"] if preset != "check" else int(torch.randint(2, p["completion"] + 1, (1,), generator=g))
            completions.append(torch.randint(9, p["vocab"], (length,), generator=g).tolist())
    n = len(prompts)
    out = Rollouts(prompts, completions, [torch.zeros(len(c)) for c in completions], ["stop"] * n, [""] * n, [{}] * n,
                   image_inputs=images)
    out.advantages = torch.randn(n, generator=g)
    out.old_logp = [-torch.rand(len(c), generator=g) * 6 for c in completions]
    return out


def to_device(batch, device):
    moved = {id(x): {k: v.to(device) for k, v in x.items()} for x in batch.image_inputs}
    batch.image_inputs = [moved[id(x)] for x in batch.image_inputs]  # (still one object per group)
    return batch


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

    return LossOptions(loss_type="grpo", beta=0.0, epsilon_low=0.2, epsilon_high=0.28, temperature=0.9, backend="auto")


# ---- the padded paths: every completion a row of its own, carrying its prompt's images ----------------------------


def padded_inputs(batch, device):
    """(model inputs over the padded rows, completion mask [B, T], targets [B, T], T): input ids left-padded prompts +
    right-padded completions, each row's images (repeated per completion, as TRL batches them)."""
    P = max(map(len, batch.prompt_ids))
    T = max(map(len, batch.completion_ids))
    B = len(batch)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        ids[i, P - len(p): P + len(c)] = torch.tensor(p + c)
        att[i, P - len(p): P + len(c)] = 1
    mask = att[:, P:].bool()
    inputs = {"input_ids": ids.to(device), "attention_mask": att.to(device),
              "mm_token_type_ids": (ids == IMAGE).int().to(device),
              "pixel_values": torch.cat([x["pixel_values"] for x in batch.image_inputs]).to(device),
              "image_grid_thw": torch.cat([x["image_grid_thw"] for x in batch.image_inputs]).to(device),
              "num_images": [len(x["image_grid_thw"]) for x in batch.image_inputs]}
    return inputs, mask.to(device), ids[:, P:].to(device), T


def padded_step(model, batch, device, *, trl: bool, rows: int):
    """One step on the padded rows in chunks of `rows` (gradient accumulation): the model's own logits (trl=False)
    or TRL's fused-head log-probs (trl=True), the spec's loss; returns the loss."""
    from grpo_fast import objective

    options = loss_options()
    inputs, mask, targets, T = padded_inputs(batch, device)
    old = torch.stack([torch.cat([o, torch.zeros(T - len(o))]) for o in batch.old_logp]).to(device)
    advantages = batch.advantages.to(device)
    B, total = len(batch), 0.0
    for start in range(0, B, rows):
        end = min(start + rows, B)
        if trl:
            logp = trl_logprobs(model, inputs, start, end, T)
        else:
            images = chunk_images(inputs, start, end)
            images.pop("num_images")
            logits = model(input_ids=inputs["input_ids"][start:end], attention_mask=inputs["attention_mask"][start:end],
                           logits_to_keep=T + 1, **images).logits[:, :-1]
            logp = objective.token_logprobs(logits, targets[start:end], options.temperature)[0]
        loss, _ = objective.grpo_loss_from_logprobs(logp, advantages[start:end], mask[start:end].float(), options,
                                                    old_logp=old[start:end])
        loss = loss * (end - start) / B
        loss.backward()
        total += float(loss.detach())
    return total


def trl_logprobs(model, inputs, start: int, end: int, T: int):
    """TRL 1.16's own per-token log-probs of rows start:end (its image slicing, its fused lm head)."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    stub = SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True))
    logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        stub, model, inputs["input_ids"][start:end], inputs["attention_mask"][start:end], T, batch_size=end - start,
        compute_entropy=True, **chunk_images(inputs, start, end))
    return logp


def chunk_images(inputs, start: int, end: int) -> dict:
    """The image inputs of rows start:end (each row's images in order, as TRL's batch slicing hands them on)."""
    cum = [0, *torch.tensor(inputs["num_images"]).cumsum(0).tolist()]
    patches = [0, *inputs["image_grid_thw"].prod(-1).cumsum(0).tolist()]
    return dict(pixel_values=inputs["pixel_values"][patches[cum[start]]:patches[cum[end]]],
                image_grid_thw=inputs["image_grid_thw"][cum[start]:cum[end]], num_images=inputs["num_images"][start:end],
                mm_token_type_ids=inputs["mm_token_type_ids"][start:end])


# ---- the fused path ------------------------------------------------------------------------------------------------


def fused_step(model, batch, max_tokens: int, keep_grads: bool = False):
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.step import train_step

    optimizer = Grads(model, keep=keep_grads)
    metrics = train_step(model, optimizer, Packer(model, max_tokens=max_tokens), batch, loss_options(),
                         max_grad_norm=0.0)
    return metrics, optimizer.grads


# ---- the checks ----------------------------------------------------------------------------------------------------


def equality(device: str) -> dict:
    """The fused path against the model's own forward, one sequence at a time (float32, the encoder trained)."""
    from grpo_fast.models import vision
    from grpo_fast.objective import grpo_loss_reference
    from grpo_fast.train.forward import Packer, completion_logprobs

    model = qwen2_vl("check").to(device)
    data = to_device(batch("check"), device)
    options = loss_options()
    rows = []
    for p, c, x in zip(data.prompt_ids, data.completion_ids, data.image_inputs, strict=True):
        ids = torch.tensor([p + c], device=device)
        logits = model(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **x).logits[0]
        rows.append(logits[len(p) - 1: len(p) + len(c) - 1])
    tc = max(len(c) for c in data.completion_ids)
    chosen = torch.stack([torch.cat([r, r.new_zeros(tc - len(r), r.shape[1])]) for r in rows])
    target = torch.stack([torch.tensor(c + [0] * (tc - len(c))) for c in data.completion_ids]).to(device)
    mask = (torch.arange(tc)[None] < torch.tensor([len(c) for c in data.completion_ids])[:, None]).float().to(device)
    old = torch.stack([torch.cat([o, torch.zeros(tc - len(o))]) for o in data.old_logp]).to(device)
    loss, _ = grpo_loss_reference(chosen, target, data.advantages.to(device), mask, options, old_logp=old)
    model.zero_grad()
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_logp = [torch.log_softmax(r.detach() / options.temperature, -1).gather(1, torch.tensor(c, device=device)[:, None])[:, 0]
                 for r, c in zip(rows, data.completion_ids, strict=True)]
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    got_logp = completion_logprobs(model, Packer(model, 4096), data.prompt_ids, data.completion_ids,
                                   temperature=options.temperature, backend="auto", images=data.image_inputs)
    metrics, grads = fused_step(model, data, 4096, keep_grads=True)
    handle.remove()

    def rel(a, b):  # |a - b| / max(1, |b|): the magnitude-scaled error the tests bound
        return float((a.double() - b.double()).abs().max()) / max(1.0, float(b.double().abs().max()))

    out = {"merge": "mm_encoder_outputs" if vision.takes_encoder_outputs(model.model) else "inputs_embeds",
           "logp_err": max(rel(g.to(device), w) for g, w in zip(got_logp, want_logp, strict=True)),
           "loss_err": abs(metrics["loss"] - float(loss)) / max(1.0, abs(float(loss))),
           "grad_err": max(rel(grads[n], g) for n, g in expected.items()),
           "same_grads": grads.keys() == expected.keys(),
           "encoder_grads": sum(n.startswith("model.visual") for n in expected),
           "encoder_calls": len(calls), "prompts": 2 * len(PRESETS["check"]["prompts"]),
           "micro_batches": metrics["num_micro_batches"]}
    out["ok"] = (out["logp_err"] < 2e-4 and out["loss_err"] < 1e-4 and out["grad_err"] < 1e-3 and out["same_grads"]
                 and out["encoder_grads"] > 0 and out["encoder_calls"] == out["prompts"])
    return out


def step_costs(device: str, dtype: str, preset: str, repeats: int, max_tokens: int, trl_batch: int,
               paths=("fused", "padded", "trl")) -> dict:
    """Time and peak memory of one training step of each path (the encoder frozen, as by default)."""
    import importlib.util

    from grpo_fast.models import vision

    results = {}
    for path in paths:
        if path == "trl" and importlib.util.find_spec("trl") is None:
            results[path] = {"skipped": "TRL is not installed"}
            continue
        model = qwen2_vl(preset).to(device, getattr(torch, dtype))
        vision.freeze_encoder(model)
        if path == "trl":
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model, temperature=loss_options().temperature, outputs=("log_probs", "entropy"))
        data = to_device(batch(preset, seed=1), device)
        step = {"fused": lambda m=model, d=data: fused_step(m, d, max_tokens)[0]["loss"],
                "padded": lambda m=model, d=data: padded_step(m, d, device, trl=False, rows=trl_batch),
                "trl": lambda m=model, d=data: padded_step(m, d, device, trl=True, rows=trl_batch)}[path]
        step()  # warm-up
        timing, peak, losses, cpu = harness.Timing(), 0, [], []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            harness.release_memory()
            with harness.PeakMemory(device, reset_rss_peak=True) as memory:
                start = time.process_time()  # (all threads' CPU seconds: steadier than wall time on a shared CPU)
                timing.times_s.append(harness.time_call(lambda s=step, out=losses: out.append(s()), device))
                cpu.append(time.process_time() - start)
            peak = max(peak, memory.extra_bytes)
        results[path] = {"best_s": timing.best_s, "median_s": timing.median_s, "cpu_s": min(cpu),
                         "peak_extra_mib": peak / 2**20, "loss": losses[-1]}
        del model
    p = PRESETS[preset]
    results["shape"] = {"prompts": len(p["prompts"]), "images_per_prompt": list(p["prompts"]), "G": p["G"],
                        "image_tokens": p["grid"][0] * p["grid"][1] // MERGE**2, "completion": p["completion"],
                        "vocab": p["vocab"], "hidden": p["hidden"], "layers": p["layers"],
                        "vision_depth": p["depth"], "vision_width": p["width"], "dtype": dtype,
                        "max_tokens": max_tokens, "trl_batch": trl_batch}
    return results


def markdown(result: dict, command: str) -> str:
    eq, steps = result["equality"], result["step"]
    lines = ["# A tiny VLM's GRPO step (check_vlm_step.py)", "", f"`{command}` on {harness.describe(result['environment'])}.",
             "", f"Equality (float32, merge via {eq['merge']}): log-probs {eq['logp_err']:.2g}, loss {eq['loss_err']:.2g}, "
             f"gradients {eq['grad_err']:.2g} (max |diff| / max(1, |expected|)); the encoder's calls "
             f"{eq['encoder_calls']} for {eq['prompts']} prompts (2 passes) -> {'ok' if eq['ok'] else 'FAILED'}", "",
             f"Step: {json.dumps(steps['shape'])}", "", "| path | best s | median s | CPU s | peak MiB | loss |",
             "| --- | --- | --- | --- | --- | --- |"]
    for path in ("fused", "padded", "trl"):
        r = steps.get(path)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"| {path} | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {path} | {r['best_s']:.3f} | {r['median_s']:.3f} | {r['cpu_s']:.2f} | {r['peak_extra_mib']:.0f} "
                     f"| {r['loss']:.6g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for check_vlm_step.json and .md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                        help="the weights' dtype in the step timings (the equality check is float32)")
    parser.add_argument("--preset", default="bench", choices=list(PRESETS), help="the timed step's model and batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4096, help="the fused path's token budget per packed row")
    parser.add_argument("--trl-batch", type=int, default=8, help="rows per forward of the padded paths")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {"command": harness.command_line(__file__, argv), "environment": harness.environment()}
    result["equality"] = equality(args.device)
    print("equality", json.dumps(result["equality"]), flush=True)
    result["step"] = step_costs(args.device, args.dtype, args.preset, args.repeats, args.max_tokens, args.trl_batch)
    print("step", json.dumps(result["step"]), flush=True)
    ok = result["equality"]["ok"] and all(math.isfinite(r.get("loss", 0.0)) for r in result["step"].values()
                                          if isinstance(r, dict) and "loss" in r)
    result["ok"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_results(out / "check_vlm_step", result, markdown(result, result["command"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

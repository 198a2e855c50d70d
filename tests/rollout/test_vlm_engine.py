"""The HF engine on tiny vision-language models (issue 51): the model's own generate with each prompt's pixel inputs.

- A prompt's images are processed once per group (the image processor's calls counted: one per prompt, not one per
  completion), the result shared by the group's completions (Rollouts.image_inputs: one object per group); a sampled
  image placeholder token ends its completion.
- The engine saw the images: each sampled token's log-prob equals the model's own forward over the prompt, its images
  and the completion (temperature 1), and differs from the same tokens scored without the images.
- Idefics3 (per-prompt pixel tensors, padded across a batch): prompts with 1 and 2 images in one batch, the same.
- Bad images arguments are refused before any work.
"""

from __future__ import annotations

import pytest
import torch

from grpo_fast.data.images import encode_image_prompts
from grpo_fast.generation.batch import from_engine
from grpo_fast.generation.engines import HFEngine
from grpo_fast.generation.engines.base import RolloutEngine
from grpo_fast.generation.images import placeholder_tokens
from tests.helpers import assert_close, scaled
from tests.tiny_vlm import image, load_tiny_vlm, tiny_vlm_dir

G = 4


class CountingImageProcessor:
    """The processor's image processor, its calls counted."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def rows(counts) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": [*[{"type": "image"}] * k, {"type": "text", "text": f"Look {i}"}]}],
             "images": [image(56 + 28 * (j % 2), 56, seed=10 * i + j) for j in range(k)]} for i, k in enumerate(counts)]


def before_image_token(model, completion: list[int]) -> list[int]:
    """The completion up to its first image placeholder token: a random model samples it now and then, and the
    model's own forward would look for an image to merge there (more image tokens than features: it refuses)."""
    token = model.config.image_token_id
    return completion[: completion.index(token)] if token in completion else completion


def own_logprobs(model, prompt, completion, inputs, with_images=True) -> torch.Tensor:
    """log p(completion tokens) from the model's own forward (logits materialised), temperature 1 (the completion up
    to its first image token)."""
    from grpo_fast.generation.engines.hf_engine import image_model_inputs

    completion = before_image_token(model, completion)
    ids = torch.tensor([prompt + completion])
    extra = image_model_inputs(model, ids, [inputs]) if with_images else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="module")
def qwen2_vl():
    return load_tiny_vlm(tiny_vlm_dir("qwen2_vl"))


def test_images_processed_once_per_group_and_seen_by_the_engine(qwen2_vl):
    model, processor = qwen2_vl
    data = rows([1, 3])
    ids, prompts, _ = encode_image_prompts(data, processor)
    counting = CountingImageProcessor(processor.image_processor)
    processor.image_processor = counting
    try:
        groups = HFEngine(model, processor.tokenizer).generate(ids, n=G, max_new_tokens=6, seed=[1, 2], images=prompts)
    finally:
        processor.image_processor = counting.inner
    assert counting.calls == len(prompts)  # one per prompt, not per completion
    batch = from_engine(groups, ids, data)
    token = model.config.image_token_id  # a sampled placeholder ends its completion (never an input of a forward)
    assert placeholder_tokens(prompts) == (token,) and all(token not in c[:-1] for c in batch.completion_ids)
    assert all(batch.image_inputs[i] is batch.image_inputs[(i // G) * G] for i in range(len(batch)))
    assert batch.image_inputs[0] is not batch.image_inputs[G]
    assert batch.image_inputs[G]["image_grid_thw"].shape == (3, 3)
    for i in range(len(batch)):
        expected = own_logprobs(model, ids[i // G], batch.completion_ids[i], batch.image_inputs[i])
        assert_close(batch.sampling_logp[i][: len(expected)], expected, atol=scaled(1e-4, expected),
                     name=f"completion {i}")
    blind = own_logprobs(model, ids[0], batch.completion_ids[0], None, with_images=False)
    assert (blind - batch.sampling_logp[0][: len(blind)]).abs().max() > 1e-3, "the images changed nothing"


def test_idefics3_pads_per_prompt_pixels_across_a_batch():
    model, processor = load_tiny_vlm(tiny_vlm_dir("idefics3"))
    data = rows([2, 1])
    ids, prompts, _ = encode_image_prompts(data, processor)
    groups = HFEngine(model, processor.tokenizer).generate(ids, n=2, max_new_tokens=5, seed=[3, 4], images=prompts)
    batch = from_engine(groups, ids, data)
    assert batch.image_inputs[0]["pixel_values"].shape[:2] == (1, 2) and batch.image_inputs[2]["pixel_values"].shape[:2] == (1, 1)
    for i in range(len(batch)):
        expected = own_logprobs(model, ids[i // 2], batch.completion_ids[i], batch.image_inputs[i])
        assert_close(batch.sampling_logp[i][: len(expected)], expected, atol=scaled(1e-4, expected),
                     name=f"completion {i}")


def test_bad_images_arguments_are_refused(qwen2_vl):
    model, processor = qwen2_vl
    ids, prompts, _ = encode_image_prompts(rows([1]), processor)
    engine = HFEngine(model, processor.tokenizer)
    with pytest.raises(ValueError, match=r"images: expected one ImagePrompt \(or None\) per prompt \(2\), got 1"):
        engine.generate([ids[0], ids[0]], n=1, max_new_tokens=2, images=prompts)
    with pytest.raises(ValueError, match=r"images\[0\]: expected an ImagePrompt or None, got Image"):
        engine.generate(ids, n=1, max_new_tokens=2, images=[image()])

    class TextOnly(RolloutEngine):
        vocab_size, max_model_len = 384, 64

    with pytest.raises(ValueError, match="TextOnly does not take images"):
        TextOnly().generate(ids, n=1, max_new_tokens=2, images=prompts)

"""Vision-language models on the fused path (grpo_fast/models/vision.py) equal the model's own forward (fp32).

Four families, tiny and random, built here (nothing downloaded): with M-RoPE (3-D positions from their own
get_rope_index) Qwen2-VL, Qwen2.5-VL (its tower's window attention) and Qwen3-VL (deepstack: tower features added
inside the decoder's first layers); without it LLaVA (a CLIP tower, a projector, a Llama). Images go through the PIL
image processor (`Qwen2VLImageProcessorPil`, `LlavaImageProcessorPil`); the prompt is a tokenizer's text around the
image placeholders, expanded as the library's processor does (Qwen2-VL: `image_grid_thw.prod() / merge_size**2`
tokens an image; LLaVA: a CLIP patch grid, the CLS token dropped).

Reference: each sequence run alone through the VLM's own forward (its pixel inputs, its own merge and positions), the
logits materialised, the GRPO loss from `objective.grpo_loss_reference`. The fused path: `train_step` /
`completion_logprobs` over one packed row holding three groups of G = 4 (prompts with 1, 3 and no image), the image
encoder trained (freeze_vision_tower=False) so that its gradient is compared too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_fast.generation.batch import Rollouts
from grpo_fast.models import vision
from grpo_fast.objective import LossOptions, grpo_loss_reference
from grpo_fast.train.forward import Packer, completion_logprobs
from grpo_fast.train.step import train_step
from tests.helpers import assert_close, scaled

G = 4
IMAGE, VISION_START, VISION_END = 300, 301, 302  # filler ids of tests/tiny_model.py's tokenizer (vocab 320)
OPTIONS = LossOptions(loss_type="grpo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28, temperature=0.9, backend="cpu")
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.1, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def tiny_vlm(family: str, seed: int = 0):
    """(model in train mode, its PIL image processor) of `family`."""
    import transformers

    if family == "qwen2_vl":  # head_dim 32: M-RoPE sections of 4 + 6 + 6 frequencies (time, height, width)
        config = transformers.Qwen2VLConfig(
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [4, 6, 6]}),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.1),
            image_token_id=IMAGE, video_token_id=303, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False)
        processor = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    elif family == "qwen2_5_vl":  # its vision tower's window attention: windows of 2 x 2 merged patches
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [4, 6, 6]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1], initializer_range=0.1),
            image_token_id=IMAGE, video_token_id=303, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False)
        processor = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    elif family == "qwen3_vl":  # deepstack: the tower's layer-0 features added to the decoder's first layer's output
        config = transformers.Qwen3VLConfig(
            text_config=dict(TEXT, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [4, 6, 6], "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0], initializer_range=0.1),
            image_token_id=IMAGE, video_token_id=303, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False)
        processor = transformers.Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16)
    elif family == "llava":  # a 28 x 28 image is a 2 x 2 grid of 14-pixel patches: 4 image tokens
        config = transformers.LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14),
            text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, tie_word_embeddings=False)
        processor = transformers.LlavaImageProcessorPil(size={"shortest_edge": 28},
                                                        crop_size={"height": 28, "width": 28})
    else:
        raise ValueError(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config).float()
    return model.train(), processor


def image(seed: int, width: int = 56, height: int = 56):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def image_prompt(family: str, processor, tokenizer, n_images: int, seed: int) -> tuple[list[int], dict]:
    """(prompt ids with each image's placeholder expanded, the image processor's outputs) of a prompt with n images."""
    images = [image(seed + k, width=56 + 28 * (k % 2)) for k in range(n_images)]
    inputs = dict(processor(images, return_tensors="pt"))
    if family.startswith("qwen"):
        merge = processor.merge_size
        counts = [int(grid.prod()) // merge**2 for grid in inputs["image_grid_thw"]]
    else:
        counts = [(processor.crop_size["height"] // 14) ** 2] * n_images
    ids = tokenizer.encode(f"Look at {n_images}:")
    for count in counts:
        ids += [VISION_START, *[IMAGE] * count, VISION_END]
    return ids + tokenizer.encode(" what is it?"), inputs


def vlm_batch(family: str, processor, n_images=(1, 3), seed: int = 0) -> Rollouts:
    """One group of G completions per prompt (a prompt with n_images[k] images), its old / reference log-probs and
    advantages random; the group's entries share one processor-output object (as the data stage hands them)."""
    from tests.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    g = torch.Generator().manual_seed(seed)
    prompts, completions, inputs = [], [], []
    for k, n in enumerate(n_images):
        ids, shared = image_prompt(family, processor, tokenizer, n, seed=seed + 10 * k) if n else \
            (tokenizer.encode("No picture: what now?"), None)
        for _ in range(G):
            prompts.append(ids)
            inputs.append(shared)
            completions.append(torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist())
    n = len(prompts)
    batch = Rollouts(prompts, completions, [torch.zeros(len(c)) for c in completions], ["stop"] * n, [""] * n, [{}] * n,
                     image_inputs=inputs)
    batch.advantages = torch.randn(n, generator=g)
    batch.old_logp = [-torch.rand(len(c), generator=g) * 6 for c in completions]
    batch.ref_logp = [-torch.rand(len(c), generator=g) * 6 for c in completions]
    return batch


def own_logits(model, prompt, completion, inputs) -> torch.Tensor:
    """[C, V]: the VLM's own forward over one sequence, its logits at the positions predicting the completion."""
    ids = torch.tensor([prompt + completion])
    extra = dict(inputs or {})
    if inputs is not None and vision.FAMILIES[model.config.model_type]:  # M-RoPE: which tokens are image tokens
        extra["mm_token_type_ids"] = (ids == IMAGE).int()
    logits = model(input_ids=ids, **extra).logits[0]
    return logits[len(prompt) - 1: len(prompt) + len(completion) - 1]


def reference(model, batch: Rollouts, options: LossOptions):
    """(loss, log-probs per sequence, gradients): one sequence at a time, logits materialised, the spec's loss."""
    rows = [own_logits(model, p, c, x) for p, c, x in zip(batch.prompt_ids, batch.completion_ids, batch.image_inputs,
                                                           strict=True)]
    tc = max(len(c) for c in batch.completion_ids)
    chosen = torch.stack([torch.cat([r, r.new_zeros(tc - len(r), r.shape[1])]) for r in rows])
    target = torch.stack([torch.tensor(c + [0] * (tc - len(c))) for c in batch.completion_ids])
    mask = (torch.arange(tc)[None] < torch.tensor([len(c) for c in batch.completion_ids])[:, None]).float()
    pad = lambda xs: torch.stack([torch.cat([x, torch.zeros(tc - len(x))]) for x in xs])  # noqa: E731
    loss, _ = grpo_loss_reference(chosen, target, batch.advantages, mask, options, old_logp=pad(batch.old_logp),
                                  ref_logp=pad(batch.ref_logp))
    model.zero_grad()
    loss.backward()
    logp = [torch.log_softmax(r.detach() / options.temperature, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            for r, c in zip(rows, batch.completion_ids, strict=True)]
    return float(loss.detach()), logp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class CaptureGrads:
    """An optimizer stand-in that keeps the gradients train_step hands it."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


class CountCalls:
    """Counts the forward calls of a module (the image encoder's tower)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, *_):
        self.calls += 1


@pytest.fixture(scope="module")
def vlms():
    """One tiny model (and image processor) per family, built once for the module; tests work on deep copies."""
    return {family: tiny_vlm(family) for family in FAMILIES}


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")


@pytest.mark.parametrize("family, merge", [(family, "backbone") for family in FAMILIES] + [("qwen2_vl", "embeddings")])
def test_fused_path_equals_the_models_own_forward(vlms, family, merge, monkeypatch):
    """Three groups of G = 4 (1 image, 3 images, a text-only prompt) packed into one row: per-token log-probs, the
    loss and every gradient (the image encoder's included) equal the model's own forward, one sequence at a time. merge: the
    backbone's own (mm_encoder_outputs), or `vision.merged_embeddings` (a transformers without that argument:
    the GPU machine's 5.17 may be one)."""
    if merge == "embeddings":
        monkeypatch.setattr(vision, "takes_encoder_outputs", lambda backbone: False)
    model, processor = copy.deepcopy(vlms[family][0]), vlms[family][1]
    batch = vlm_batch(family, processor, n_images=(1, 3, 0))
    expected_loss, expected_logp, expected_grads = reference(model, batch, OPTIONS)
    packer = Packer(model, max_tokens=4096)
    (mb,) = packer.micro_batches(batch.prompt_ids, batch.completion_ids, images=batch.image_inputs)  # one row
    assert len(mb.rows) == 3 * G and len(mb.images.inputs) == 2 and mb.images.of_sequence.count(-1) == G
    if vision.FAMILIES[family]:  # [4, 1, L]: text positions, then M-RoPE's three, each sequence's own from 0
        starts = mb.cu_seq_lens[:-1].long()
        assert mb.position_ids.shape == (4, 1, mb.num_tokens) and (mb.position_ids[:, 0, starts] == 0).all()
    logp = completion_logprobs(model, packer, batch.prompt_ids, batch.completion_ids, temperature=OPTIONS.temperature,
                               backend="cpu", images=batch.image_inputs)
    for i, (got, want) in enumerate(zip(logp, expected_logp, strict=True)):
        assert_close(got, want, atol=scaled(2e-5, want), rtol=1e-5, name=f"{family} log-probs of sequence {i}")
    optimizer = CaptureGrads(model)
    metrics = train_step(model, optimizer, packer, batch, OPTIONS, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] == 1
    assert_close(metrics["loss"], expected_loss, atol=scaled(1e-5, expected_loss), name=f"{family} loss")
    encoder = tuple(vision.encoder_modules(model))
    assert any(name.startswith(encoder) for name in expected_grads)  # the encoder's gradient is compared too
    assert optimizer.grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"{family} grad {name}")


def test_image_encoder_runs_once_per_prompt_not_per_completion(vlms):
    """Three groups of G = 4 over two micro-batches: the tower runs 3 times per training step (and per no-grad
    pass), not 12, each group kept in one micro-batch; frozen (the default), its features carry no autograd."""
    model, processor = copy.deepcopy(vlms["qwen2_vl"][0]), vlms["qwen2_vl"][1]
    vision.freeze_encoder(model)
    batch = vlm_batch("qwen2_vl", processor, n_images=(1, 3, 1), seed=3)
    tower = CountCalls(model.model.visual)
    lengths = [len(p) + len(c) - 1 for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    packer = Packer(model, max_tokens=max(sum(lengths[k:k + G]) for k in range(0, len(lengths), G)) + 8)
    metrics = train_step(model, CaptureGrads(model), packer, batch, OPTIONS, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] >= 2 and tower.calls == 3
    completion_logprobs(model, packer, batch.prompt_ids, batch.completion_ids, temperature=1.0, backend="cpu",
                        images=batch.image_inputs)
    assert tower.calls == 6
    assert not any(p.grad is not None for p in model.model.visual.parameters())


def test_bad_image_inputs_are_refused_in_one_line(vlms):
    model, processor = copy.deepcopy(vlms["llava"][0]), vlms["llava"][1]
    batch = vlm_batch("llava", processor, n_images=(1,))
    packer = Packer(model, max_tokens=4096)
    prompt = batch.prompt_ids[0]
    cut = prompt.index(IMAGE)
    short = [prompt[:cut] + prompt[cut + 1:]] * G  # one image token fewer than the image's features
    with pytest.raises(ValueError, match=r"^sample 0: its prompt has 3 image tokens \(id 300\) but its images give 4"):
        completion_logprobs(model, packer, short, batch.completion_ids, temperature=1.0, backend="cpu",
                            images=batch.image_inputs)
    with pytest.raises(ValueError, match=r"^images of sample 0: expected the prompt's image processor outputs"):
        list(packer.micro_batches(batch.prompt_ids, batch.completion_ids, images=[{"pixels": 1}] * G))
    with pytest.raises(ValueError, match=r"^images: expected one entry per sample \(4\), got 1"):
        list(packer.micro_batches(batch.prompt_ids, batch.completion_ids, images=batch.image_inputs[:1]))
    with pytest.raises(ValueError, match=r"^sample 0: its prompt holds 4 image placeholder tokens \(id 300\) but no "
                                         r"images came with it"):
        completion_logprobs(model, packer, batch.prompt_ids, batch.completion_ids, temperature=1.0, backend="cpu")
    sampled = [c[:1] + [IMAGE] + c[1:] if i == 3 else c for i, c in enumerate(batch.completion_ids)]
    with pytest.raises(ValueError, match=r"^sample 3: its completion holds the image placeholder token \(id 300\) "
                                         r"before its last token"):
        completion_logprobs(model, packer, batch.prompt_ids, sampled, temperature=1.0, backend="cpu",
                            images=batch.image_inputs)
    ended = [c + [IMAGE] for c in batch.completion_ids]  # (a sampled placeholder as the last token: only a target)
    completion_logprobs(model, packer, batch.prompt_ids, ended, temperature=1.0, backend="cpu", images=batch.image_inputs)


def test_vlms_without_support_are_refused_by_name():
    import transformers

    with pytest.raises(ValueError, match=r"gemma3 vision-language models are not supported with images .*"
                                         r"bidirectionally within an image"):
        vision.check_images_supported(transformers.Gemma3Config(), "the policy")
    with pytest.raises(ValueError, match=r"\(llama\) is not a vision-language model"):
        vision.check_images_supported(transformers.LlamaConfig(), "the policy")


def test_freeze_vision_tower_and_lora_on_the_language_model_only(vlms):
    """prepare_policy on a VLM: the encoder frozen by default; with use_peft and all-linear, LoRA layers only in the
    language model (LLaVA's CLIP tower has q_proj/k_proj/v_proj as the Llama does)."""
    from grpo_fast.config import GRPOConfig
    from grpo_fast.models.policy import ContextBudget, PolicyOptions, prepare_policy
    from grpo_fast.models.precision import Precision

    config = GRPOConfig(use_peft=True, mixed_precision="no", vllm_dtype="float32")
    budget = ContextBudget(None, 16, "max_completion_length")
    model, _, _ = prepare_policy(PolicyOptions.from_config(config), Precision.from_config(config), budget, config,
                                 copy.deepcopy(vlms["llava"][0]), tokenizer=object())
    lora_layers = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert lora_layers and all(".language_model." in n for n in lora_layers)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".language_model." not in n)
    plain, _, _ = prepare_policy(PolicyOptions.from_config(GRPOConfig()), Precision.from_config(config), budget, config,
                                 copy.deepcopy(vlms["llava"][0]), tokenizer=object())
    encoder = tuple(vision.encoder_modules(plain))
    assert all(p.requires_grad != n.startswith(encoder) for n, p in plain.named_parameters())

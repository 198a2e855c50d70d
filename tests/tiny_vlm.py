"""Tiny random vision-language models with a byte-level tokenizer, written to folders transformers and vLLM load.
No downloads: the tokenizer is built with `tokenizers`, the weights are random, the images are drawn in the test.

    from tests.tiny_vlm import build_tiny_qwen2_vl, load_tiny_vlm, images_rows
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm"))   # -> str, the folder
    model, processor = load_tiny_vlm(path)                        # fp32 Qwen2VLForConditionalGeneration, processor

Qwen2-VL (M-RoPE): text hidden 128, 2 heads of 64 (vLLM's CPU attention rejects head_dim 16), 2 layers, vocab 384;
vision tower depth 2, width 32, patch 14, spatial merge 2 (a 56 x 56 image is a 4 x 4 patch grid: 4 image tokens).
Token ids: 0 <pad>, 1 <s>, 2 </s>, 3..258 the 256 bytes, then the Qwen chat and vision specials, fillers after.
The chat template renders an image part as `<|vision_start|><|image_pad|><|vision_end|>` (Qwen2-VL's), and the
processor (grpo_fast.data.vision) expands each `<|image_pad|>` to the image's feature count.

LLaVA (1-D positions, no M-RoPE): a CLIP vision tower (width 64, 2 heads of 32, 2 layers) on the same Llama-sized text
model; an image is resized to 28 x 28, 4 image tokens (`<image>`, repeated by the processor).
"""

from __future__ import annotations

import os

VOCAB_SIZE = 384
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIALS = [*QWEN_SPECIALS, "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]  # (LLaVA's, Idefics3's)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen2-VL's template writes for an image part


def chat_template(image_placeholder: str = QWEN_IMAGE) -> str:
    """Qwen2-VL's template, cut to what the tests use: turns of text and image parts (an image part is written as
    `image_placeholder`)."""
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}"
            "{% if part['type'] == 'image' %}" + image_placeholder +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vlm_tokenizer(vocab_size: int = VOCAB_SIZE, image_placeholder: str = QWEN_IMAGE):
    """A byte-level BPE tokenizer without merges, with Qwen's chat and vision special tokens and LLaVA's `<image>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    pieces = [PAD, BOS, EOS, *byte_chars, *SPECIALS]
    pieces += [f"<t{i}>" for i in range(len(pieces), vocab_size)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS, *SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token="<|im_end|>", pad_token=PAD,
                                   chat_template=chat_template(image_placeholder))


def tiny_qwen2_vl_config(tokenizer, **text_overrides):
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=ids["<|im_end|>"],
                pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [16, 8, 8]})
    text.update(text_overrides)
    vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.1)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def build_tiny_qwen2_vl(path: str | os.PathLike, *, seed: int = 0, **text_overrides) -> str:
    """Write a random tiny Qwen2-VL (fp32 safetensors), its tokenizer and its PIL image processor to `path`."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    path = os.fspath(path)
    tokenizer = build_vlm_tokenizer()
    config = tiny_qwen2_vl_config(tokenizer, **text_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).float()
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # small images stay small: at most 16 x 16 patches (64 image tokens after the 2 x 2 merge)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224).save_pretrained(path)
    return path


def build_tiny_llava(path: str | os.PathLike, *, seed: int = 0, image_size: int = 28) -> str:
    """Write a random tiny LLaVA (CLIP vision tower, Llama text: 1-D positions), its tokenizer and processor to
    `path`: an image is resized to image_size x image_size, (image_size / 14)**2 image tokens (4 by default)."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    path = os.fspath(path)
    tokenizer = build_vlm_tokenizer(image_placeholder="<image>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=image_size, patch_size=14, projection_dim=64)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         image_seq_length=(image_size // 14) ** 2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).float()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14, image_token="<image>",
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=tokenizer.chat_template).save_pretrained(path)
    return path


def build_tiny_idefics3(path: str | os.PathLike, *, seed: int = 0, image_size: int = 56) -> str:
    """Write a random tiny Idefics3 (SmolVLM's architecture: a SigLIP-like tower, pixel shuffle by 2, Llama text:
    1-D positions), its tokenizer and processor to `path`: an image is resized to image_size x image_size (no
    splitting into tiles), ((image_size / 14) / 2)**2 image tokens (4 by default) between its markers."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    path = os.fspath(path)
    tokenizer = build_vlm_tokenizer(image_placeholder="<image>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=14)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, pad_token_id=0,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).float()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                                max_image_size={"longest_edge": image_size})
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                      image_seq_len=((image_size // 14) // 2) ** 2,
                      chat_template=tokenizer.chat_template).save_pretrained(path)
    return path


def load_tiny_vlm(path: str | os.PathLike, dtype=None):
    """(model in eval mode, grpo_fast's processor) from a folder written by a builder here; fp32 by default."""
    import torch
    from transformers import AutoModelForImageTextToText

    from grpo_fast.data.vision import load_processor

    model = AutoModelForImageTextToText.from_pretrained(os.fspath(path), dtype=dtype or torch.float32)
    return model.eval(), load_processor(os.fspath(path))


def image(width: int = 56, height: int = 56, seed: int = 0):
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_rows(n: int, *, images_per_row: int = 1, seed: int = 0) -> list[dict]:
    """n rows in TRL's format: a conversational prompt with `images_per_row` image parts, an `images` column."""
    rows = []
    for i in range(n):
        parts = [{"type": "image"}] * images_per_row + [{"type": "text", "text": f"What is in picture {i}?"}]
        rows.append({"prompt": [{"role": "user", "content": parts}],
                     "images": [image(56 + 28 * (k % 2), 56, seed=seed + 10 * i + k) for k in range(images_per_row)],
                     "answer": str(i)})
    return rows


_BUILT: dict = {}


def tiny_vlm_dir(family: str = "qwen2_vl") -> str:
    """The folder of a tiny VLM of `family` (qwen2_vl, llava, idefics3), built once per test process (several test
    modules share it; the folder lives until the process exits)."""
    import atexit
    import shutil
    import tempfile

    if family not in _BUILT:
        build = {"qwen2_vl": build_tiny_qwen2_vl, "llava": build_tiny_llava, "idefics3": build_tiny_idefics3}[family]
        path = tempfile.mkdtemp(prefix=f"tiny_{family}_")
        atexit.register(shutil.rmtree, path, True)
        _BUILT[family] = build(path)
    return _BUILT[family]

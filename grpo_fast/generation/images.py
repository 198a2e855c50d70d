"""A prompt's images as the engines take them, and processed once for the prompt's whole group.

The data stage (grpo_fast/data/images.py) checks a dataset's images and expands each prompt's image placeholders with
the model's processor (the prompt ids the trainer trains on hold every image token). What an engine needs beside
those ids is an `ImagePrompt`: the images as the row gave them (PIL images, paths or bytes, opened here), the prompt's
ids *before* the processor expanded the placeholders (vLLM takes those with the images as multimodal data and expands
them itself) and the processor. `ImagePrompt.process` runs the image processor once; an engine calls it once per
prompt of a `generate` call and hands the one result (`pixel_values`, `image_grid_thw`, ...) to each of the prompt's
n completions (`Completion.image_inputs`, then `Rollouts.image_inputs`): the trainer encodes it once per prompt too
(models/vision.py).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# processor outputs that describe the text, not the images: the prompt ids carry them (or they follow from the ids)
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def open_image(source, base_dir: Optional[str] = None):
    """A PIL image (RGB) from a PIL image, a path (relative paths from `base_dir`), raw bytes, or a dict as HF datasets
    store an Image feature ({"bytes": ..., "path": ...}). Raises what PIL raises (OSError / ValueError)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, dict) and ("bytes" in source or "path" in source):
        data, path = source.get("bytes"), source.get("path")
        return open_image(data if data is not None else path, base_dir)
    elif isinstance(source, (bytes, bytearray)):
        image = Image.open(io.BytesIO(source))
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if base_dir is not None and not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        image = Image.open(path)
    else:
        raise TypeError(f"expected a PIL image, a path, bytes or a {{'bytes', 'path'}} dict, got {type(source).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """One prompt's images for the engines.

    sources: the row's images (PIL images, paths, bytes, {"bytes", "path"} dicts), opened when the engine samples;
    placeholder_ids: the prompt's token ids as the chat template wrote them, one placeholder per image (what vLLM takes);
    processor: the model's processor (grpo_fast.data.vision.load_processor): its image processor makes the pixels;
    base_dir: where relative image paths start (a JSONL file's folder).
    """

    sources: tuple
    placeholder_ids: tuple
    processor: Any
    base_dir: Optional[str] = None

    def images(self) -> list:
        """The prompt's images, opened (PIL, RGB)."""
        return [open_image(s, self.base_dir) for s in self.sources]

    def process(self) -> dict:
        """The image processor's outputs for the prompt's images, the model's image inputs (`pixel_values`, and
        `image_grid_thw` for the M-RoPE families, `pixel_attention_mask` for Idefics3, ...): run once per call."""
        out = self.processor.image_processor(images=self.images(), return_tensors="pt")
        import torch

        return {k: v for k, v in out.items() if k not in TEXT_KEYS and isinstance(v, torch.Tensor)}


def check_image_prompts(images: Optional[Sequence], n_prompts: int) -> Optional[list]:
    """`generate`'s images argument: None, or one `ImagePrompt` (or None: a text-only prompt) per prompt."""
    if images is None:
        return None
    if isinstance(images, (str, bytes)) or not isinstance(images, Sequence) or len(images) != n_prompts:
        got = len(images) if isinstance(images, Sequence) else type(images).__name__
        raise ValueError(f"images: expected one ImagePrompt (or None) per prompt ({n_prompts}), got {got}")
    for i, p in enumerate(images):
        if p is not None and not isinstance(p, ImagePrompt):
            raise ValueError(f"images[{i}]: expected an ImagePrompt or None, got {type(p).__name__}")
    return list(images) if any(p is not None for p in images) else None


def placeholder_tokens(images: list) -> tuple[int, ...]:
    """The image placeholder token ids of the processors of a call's prompts (their `image_token_id`, or their
    `image_token`'s id). `generate` makes them stop tokens: a completion that samples one ends there, the token kept
    as its last, which no forward takes as input (the trainer's forward over prompt + completion stops before the
    last token), so no pass looks for an image to merge where the model wrote a placeholder (a model never means to;
    a random one does, now and then)."""
    ids = set()
    for p in images:
        if p is None:
            continue
        token = getattr(p.processor, "image_token_id", None)
        if token is None and getattr(p.processor, "image_token", None) is not None:
            token = p.processor.tokenizer.convert_tokens_to_ids(p.processor.image_token)
        if token is not None:
            ids.add(int(token))
    return tuple(sorted(ids))


def processed(images: Optional[list]) -> list:
    """Each prompt's image inputs, processed once (None for a text-only prompt): what its completions share."""
    return [None if p is None else p.process() for p in images] if images is not None else []

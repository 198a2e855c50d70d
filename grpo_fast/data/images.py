"""Datasets with images (TRL's format), checked and encoded before any work.

A row holds a conversational prompt and an `image` column (one image) or an `images` column (a list), each image a
PIL image, a path (relative to the dataset file's folder), raw bytes or an HF datasets Image dict
({"bytes", "path"}). The prompt's messages mark where the images go with `{"type": "image"}` parts, one per image in
order; a prompt whose messages are plain strings gets its images before the first user message's text (TRL's rule:
`prepare_multimodal_messages`).

`encode_image_prompts` checks every row (its images open, as an image, within PIL's decompression-bomb limit and the
processor's own limits; as many images as image parts; the expanded prompt within max_prompt_length: cutting a
prompt would cut its image tokens) and either refuses in one line naming the bad rows and why, or, with
`bad_images="skip"`, drops and counts them. It renders each prompt with the processor's chat template and expands the
image placeholders with the processor (the prompt ids the trainer trains on) and keeps, per row, what the engine
needs (`generation.images.ImagePrompt`: the image sources, the ids before expansion, the processor). The pixels are
made again when a prompt is sampled (once per group): keeping every row's pixels would hold the whole dataset's.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

from ..generation.images import ImagePrompt, open_image

logger = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "images")
BAD_IMAGES = ("error", "skip")  # bad_images' choices
_NAMED = 5  # bad rows named in a refusal (the rest counted)


def image_column(rows: Sequence[dict], where: str = "dataset") -> Optional[str]:
    """The column of `rows` that holds images ("image" or "images"), or None for a text-only dataset."""
    found = [c for c in IMAGE_COLUMNS if any(c in row for row in rows)]
    if len(found) > 1:
        raise ValueError(f"{where}: both an 'image' and an 'images' column; expected one of them (TRL's format: 'image' "
                         f"holds one image, 'images' a list)")
    return found[0] if found else None


def row_sources(row: dict, column: Optional[str]) -> list:
    """A row's images as given (an 'image' column: one value or None; 'images': a list, or None)."""
    if column is None or row.get(column) is None:
        return []
    value = row[column]
    if column == "image":
        return [value]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_parts(prompt) -> int:
    """The `{"type": "image"}` parts of a conversational prompt."""
    if not isinstance(prompt, list):
        return 0
    return sum(1 for m in prompt if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def multimodal_messages(prompt, n_images: int) -> list:
    """The prompt as messages of content parts, as the processors' chat templates take them: a string prompt becomes a
    user message; string contents become text parts, and where no message marks its images, the images go before the
    first user message's text (TRL's rule)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    place = image_parts(messages) == 0
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if place and m["role"] == "user":
                parts, place = [{"type": "image"}] * n_images + parts, False
            m = {**m, "content": parts}
        out.append(m)
    return out


def image_base_dir(dataset: Optional[str]) -> Optional[str]:
    """Where a dataset's relative image paths start: the folder of a dataset file, or the dataset folder."""
    if dataset is None:
        return None
    dataset = os.fspath(dataset)
    return dataset if os.path.isdir(dataset) else os.path.dirname(os.path.abspath(dataset))


def _why_not(source, base_dir: Optional[str]) -> Optional[str]:
    """Why a source is not a usable image (missing file, not an image, over PIL's pixel limit), or None."""
    from PIL import Image

    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        full = path if base_dir is None or os.path.isabs(path) else os.path.join(base_dir, path)
        if not os.path.isfile(full):
            return f"no such image file {full!r}"
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # (over the limit: refused, not warned)
            image = open_image(source, base_dir)
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        return f"too large to open ({err})"
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a file that is not an image
        return f"not a readable image ({type(err).__name__}: {str(err)[:120]})"
    return None


def encode_image_prompts(rows: Sequence[dict], processor, *, prompt_column: str = "prompt",
                         max_prompt_length: Optional[int] = None, base_dir: Optional[str] = None,
                         chat_template_kwargs: Optional[dict] = None, bad_images: str = "error",
                         where: str = "train_dataset") -> tuple[list[list[int]], list[Optional[ImagePrompt]], list[int]]:
    """Each row's prompt ids (image placeholders expanded) and its `ImagePrompt` (None: a text-only row), checked.

    Args:
        rows: N rows with a prompt column (chat messages, or a string) and an 'image' or 'images' column.
        processor: the model's processor (grpo_fast.data.vision.load_processor).
        max_prompt_length: the most tokens a prompt may have once its images are expanded (None: no limit).
        base_dir: where relative image paths start (`image_base_dir`).
        bad_images: "error" refuses a dataset with a bad row, naming the rows (up to 5) and why, before any work;
            "skip" drops those rows and logs how many, and which.

    Returns:
        (ids, image prompts, kept row indices): the rows kept (all, unless skipped) in order.
    """
    if bad_images not in BAD_IMAGES:
        raise ValueError(f"bad_images: expected one of {BAD_IMAGES}, got {bad_images!r}")
    column = image_column(rows, where)
    tokenizer = processor.tokenizer
    ids, prompts, kept, bad = [], [], [], []
    for i, row in enumerate(rows):
        sources = row_sources(row, column)
        problem = _row_problem(row, sources, prompt_column, base_dir)
        encoded = None
        if problem is None:
            encoded, problem = _encode_row(row[prompt_column], sources, processor, tokenizer, chat_template_kwargs,
                                           base_dir)
        if problem is None and max_prompt_length is not None and len(encoded[0]) > max_prompt_length:
            problem = (f"{len(encoded[0])} prompt tokens with its images expanded > max_prompt_length="
                       f"{max_prompt_length} (a prompt with images is never cut: raise max_prompt_length)")
        if problem is not None:
            bad.append((i, problem))
            continue
        full, placeholders = encoded
        ids.append(full)
        prompts.append(ImagePrompt(tuple(sources), tuple(placeholders), processor, base_dir) if sources else None)
        kept.append(i)
    if bad:
        named = "; ".join(f"row {i}: {why}" for i, why in bad[:_NAMED])
        more = f" (and {len(bad) - _NAMED} more rows)" if len(bad) > _NAMED else ""
        if bad_images == "error" or not kept:
            raise ValueError(f"{where}: {len(bad)} of {len(rows)} rows have bad images: {named}{more}; fix or drop them "
                             f"(bad_images='skip' drops them)")
        logger.warning("%s: dropped %d of %d rows with bad images (bad_images='skip'): %s%s", where, len(bad), len(rows),
                       named, more)
    return ids, prompts, kept


def _row_problem(row: dict, sources: list, prompt_column: str, base_dir: Optional[str]) -> Optional[str]:
    prompt = row[prompt_column]
    parts = image_parts(prompt)
    if parts and parts != len(sources):
        return f"its prompt has {parts} image part(s) but {len(sources)} image(s) were given"
    for k, source in enumerate(sources):
        why = _why_not(source, base_dir)
        if why is not None:
            return f"image {k}: {why}"
    return None


def _encode_row(prompt, sources: list, processor, tokenizer, chat_template_kwargs, base_dir):
    """((expanded ids, placeholder ids), None), or (None, why the processor refused the row's images)."""
    messages = multimodal_messages(prompt, len(sources))
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))
    placeholders = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not sources:
        return (placeholders, placeholders), None
    try:
        out = processor(text=[text], images=[[open_image(s, base_dir) for s in sources]], add_special_tokens=False)
    except Exception as err:  # noqa: BLE001 - the processor's own limits (sizes, aspect ratios) raise many kinds
        return None, f"the processor refused its images ({type(err).__name__}: {str(err)[:160]})"
    full = out["input_ids"][0]
    return (list(full.tolist() if hasattr(full, "tolist") else full), placeholders), None

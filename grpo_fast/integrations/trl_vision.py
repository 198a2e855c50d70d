"""The TRL backend's vision-language path: TRL 1.16's own VLM batches, the fused loss in place of its logits.

TRL hands its log-prob passes a VLM's image inputs beside the token ids (`pixel_values`, `image_grid_thw`, its own
`num_images`, ...). They go to the model's multimodal backbone (`lm.model`: the image features merged into the language
model's inputs, the M-RoPE positions of the Qwen-VL families, Gemma 3's image blocks from token_type_ids), whose final
hidden states the fused ops take in place of TRL's lm_head and log-softmax (integrations/trl.py). A pass over row
chunks gives each chunk its own images by TRL's layouts (`rows_image_inputs`). The backbone runs per completion, as in
TRL (the native trainer encodes a prompt's images once: models/vision.py).
"""

from __future__ import annotations

from ..models.moe import completion_hidden_and_router_loss

# Model inputs of vision-language models as TRL 1.16 hands them to its log-prob passes (`num_images`: its own, the
# images of each row), by what their first axis counts: images (or an image's patches, by image_grid_thw), or rows
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                   "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_tiles", "num_images")
_PER_IMAGE_KEYS = ("image_grid_thw", "image_sizes", "image_position_ids")
_PER_ROW_KEYS = ("pixel_attention_mask", "token_type_ids", "mm_token_type_ids")
# tile-indexed layouts (LFM2-VL's spatial_shapes, InternVL's num_tiles): not checked here, refused by name
_REFUSED_KEYS = ("spatial_shapes", "num_tiles")


def multimodal_backbone(lm, given=()):
    """The VLM's multimodal backbone (`lm.model`): its forward takes the image inputs, merges the image features into
    the language model's inputs (and, for the M-RoPE families, builds the 3-D positions) and returns the final hidden
    states, what the lm_head multiplies, so the fused ops replace exactly TRL's lm_head and log-softmax.
    given: the image inputs at hand (named where the model has no such backbone)."""
    backbone = lm.base_model
    if backbone is lm or not hasattr(backbone, "get_image_features"):
        inputs = f"multimodal inputs {sorted(given)} given, but " if given else ""
        raise ValueError(f"{inputs}{type(lm).__name__} has no multimodal backbone (get_image_features at "
                         f"lm.{lm.base_model_prefix}) for the fused path to run the images through; use a "
                         f"vision-language model or trl.GRPOTrainer")
    return backbone


def image_inputs(values: dict) -> dict:
    """The multimodal model inputs among `values` (TRL's batch, or its log-prob pass's keyword arguments), given ones
    only; the tile-indexed layouts are refused by name."""
    given = {key: values[key] for key in MULTIMODAL_KEYS if values.get(key) is not None}
    refused = [key for key in _REFUSED_KEYS if key in given]
    if refused:
        raise ValueError(f"multimodal inputs {refused} (tile-indexed images: LFM2-VL, InternVL) are not supported by the "
                         f"fused path; use trl.GRPOTrainer")
    return given


def rows_image_inputs(images: dict, start: int, end: int, rows: int) -> dict:
    """The image inputs of rows start:end of a batch of `rows` (TRL 1.16's layouts): pixel_values by image patches
    (image_grid_thw), by image (one entry per image: num_images), or by row; the per-image and per-row tensors by
    their axis. num_images (TRL's own) is dropped: the model does not take it."""
    num_images = images.get("num_images")
    if start == 0 and end == rows:
        return {k: v for k, v in images.items() if k != "num_images"}
    assert num_images is not None, "a chunk of a batch with images needs TRL's num_images"
    first, last = sum(num_images[:start]), sum(num_images[:end])
    out = {}
    pixels, grid = images.get("pixel_values"), images.get("image_grid_thw")
    if pixels is not None and grid is not None:  # Qwen-VL: an image's rows of patches, grid t x h x w of them
        patches = grid.prod(-1).tolist()
        out["pixel_values"] = pixels[sum(patches[:first]) : sum(patches[:last])]
    elif pixels is not None and pixels.size(0) == sum(num_images):
        out["pixel_values"] = pixels[first:last]
    elif pixels is not None:
        out["pixel_values"] = pixels[start:end]
    for key in _PER_IMAGE_KEYS:
        if key in images:
            out[key] = images[key][first:last]
    for key in _PER_ROW_KEYS:
        if key in images:
            out[key] = images[key][start:end]
    return out


def completion_hidden(lm, input_ids, attention_mask, logits_to_keep, router, images: dict):
    """(hidden `[B, logits_to_keep, H]`, router loss or None): the text decoder's (`models.moe`), or with image
    inputs the multimodal backbone's over the images (a VLM's router loss is refused when the trainer is built)."""
    if not images:
        return completion_hidden_and_router_loss(lm, input_ids, attention_mask, logits_to_keep, router)
    out = multimodal_backbone(lm, images)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, -logits_to_keep - 1 : -1], None

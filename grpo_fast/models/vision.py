"""Vision-language models (VLMs) on the fused path: the image encoder runs once per prompt, the model's own code
merges its features into the decoder's inputs, and the final hidden states go to the fused loss as for text.

A transformers 5.19 VLM (`Qwen2VLForConditionalGeneration`, `LlavaForConditionalGeneration`, ...) is
`lm_head(backbone(input_ids, images))`. Its backbone (`lm.model`) runs the image encoder (`get_image_features`: the
vision tower and its projector or merger), writes the features over the prompt's image placeholder tokens in
`inputs_embeds` (`get_placeholder_mask`, which also checks that their counts agree) and runs the language model. The
fused path keeps the backbone as the decoder (`adapter.decoder_of`) and passes it the features computed beforehand
(`mm_encoder_outputs`, the backbone's own argument for them): `encoder_outputs` runs the encoder once per distinct
prompt of a packed row, and `row_encoder_outputs` lists each prompt's features once per sequence that shows it, the
same tensors, so the G completions of a group share one encoder pass and, where the encoder trains, one backward
through it (their gradients sum into the shared features first).

Positions: the M-RoPE families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) place image tokens on a 3-D (time, height, width)
grid, from the backbone's own `get_rope_index` over the prompt (`prompt_positions`); the completion continues as
text from there, as the model's generate does (position = index + the prompt's rope delta). A packed row carries
each sequence's own positions, restarting per sequence (`RowImages.of`), as `[4, 1, L]`: the text positions first
(what transformers reads to tell packed sequences apart), then the three M-RoPE rows. Families without M-RoPE
(LLaVA) keep the text positions.

Families: every one here was checked against the model's own forward with materialised logits
(tests/models/test_vision.py). Gemma 3's image tokens attend bidirectionally within an image (`token_type_ids`),
which packed rows do not reproduce: refused by name, with every other VLM not listed (their text-only training
is as before).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

# model_type -> whether its positions are M-RoPE's 3-D ones (the backbone's get_rope_index)
FAMILIES = {"qwen2_vl": True, "qwen2_5_vl": True, "qwen3_vl": True, "llava": False}
REFUSED = {
    "gemma3": "its image tokens attend bidirectionally within an image (token_type_ids), which packed rows do not "
              "reproduce",
    "gemma3n": "its image tokens attend bidirectionally within an image (token_type_ids), which packed rows do not "
               "reproduce",
}
# processor outputs that describe the text, not the images (the prompt ids already hold the placeholder tokens)
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# the fields of an encoder output that the backbones' forwards read (per image: one tensor each; Qwen3-VL's
# deepstack_features: per decoder layer it feeds, one tensor per image)
PER_IMAGE_FIELDS = ("pooler_output",)
PER_LAYER_PER_IMAGE_FIELDS = ("deepstack_features",)


def is_vision_language(model_config) -> bool:
    """A config with a vision sub-config: a transformers VLM (whether its images are supported or not)."""
    return getattr(model_config, "vision_config", None) is not None


def supports_images(model_config) -> bool:
    return is_vision_language(model_config) and getattr(model_config, "model_type", None) in FAMILIES


def check_images_supported(model_config, name: str = "model") -> None:
    """Raise a ValueError naming the model's family unless the fused path trains it on images."""
    kind = getattr(model_config, "model_type", None)
    if supports_images(model_config):
        return
    if not is_vision_language(model_config):
        raise ValueError(f"{name} ({kind}) is not a vision-language model: prompts with images need one of the "
                         f"families {sorted(FAMILIES)}")
    why = REFUSED.get(kind, "it was not checked against its own forward here")
    raise ValueError(f"{name}: {kind} vision-language models are not supported with images on the fused path ({why}); "
                     f"supported: {', '.join(sorted(FAMILIES))}")


def backbone_of(lm: nn.Module) -> nn.Module:
    """The multimodal backbone of a supported VLM (`lm.model`): its forward takes `mm_encoder_outputs` and ends with
    the final hidden states (the language model's final norm), what the lm_head would multiply."""
    backbone = lm.base_model
    if backbone is lm or not hasattr(backbone, "get_image_features") or not hasattr(backbone, "language_model"):
        raise ValueError(f"{type(lm).__name__} has no multimodal backbone (get_image_features and language_model) "
                         f"at lm.{lm.base_model_prefix}")
    return backbone


def is_backbone(decoder: nn.Module) -> bool:
    """`decoder` is a VLM's multimodal backbone (what `adapter.decoder_of` gives for a supported VLM)."""
    return hasattr(decoder, "get_image_features") and hasattr(decoder, "language_model")


def check_placeholders(prompt_ids, completion_ids, images, token: int, samples) -> None:
    """Before any forward over `samples` of a supported VLM: a prompt with image placeholders comes with its images
    (else the decoder would read the placeholder token's own embedding there, silently: a pass that did not hand the
    batch's image inputs on), and where the batch has images no completion holds a placeholder before its last token
    (the backbone writes image features over every placeholder of a row; generation stops at a sampled one:
    generation/images.py). One line naming the sample."""
    with_images = images is not None and any(x is not None for x in images)
    for i in samples:
        if (images is None or images[i] is None) and token in prompt_ids[i]:
            raise ValueError(f"sample {i}: its prompt holds {list(prompt_ids[i]).count(token)} image placeholder tokens "
                             f"(id {token}) but no images came with it: pass the batch's image_inputs "
                             f"(Rollouts.image_inputs) to the pass that packs it")
        if with_images and token in completion_ids[i][:-1]:
            raise ValueError(f"sample {i}: its completion holds the image placeholder token (id {token}) before its "
                             f"last token, where no image is; a batch with images trains only completions that stop at "
                             f"a sampled placeholder (the engines' stop tokens)")


def language_model_of(decoder: nn.Module) -> nn.Module:
    """The module whose attention packed rows switch (`train.attention.packed_attention`): a VLM backbone's language
    model (switching the backbone's composite config would switch its vision encoder's attention too), else
    `decoder` itself."""
    return decoder.language_model if is_backbone(decoder) else decoder


def encoder_modules(lm: nn.Module) -> dict[str, nn.Module]:
    """The image encoder of a supported VLM, by qualified name in `lm`: every child of the backbone but its language
    model (Qwen's `visual`, with its merger; LLaVA's `vision_tower` and `multi_modal_projector`)."""
    backbone = backbone_of(lm)
    prefix = next(name for name, m in lm.named_modules() if m is backbone)
    return {f"{prefix}.{name}": child for name, child in backbone.named_children() if name != "language_model"}


def freeze_encoder(lm: nn.Module) -> None:
    """freeze_vision_tower: the image encoder (tower and projector) takes no gradient; its features are then computed
    without autograd, and the optimizer holds the language model and lm_head alone."""
    for module in encoder_modules(lm).values():
        module.requires_grad_(False)


def lora_exclusions(lm: nn.Module) -> str:
    """PEFT's `exclude_modules` (a regex, full-matched against module names) that keeps LoRA on the language model:
    every module of the image encoder (all-linear and names like q_proj reach a CLIP tower's layers too)."""
    return "(" + "|".join(re.escape(name) for name in encoder_modules(lm)) + r")(\..*)?"


def language_model_lora(lm: nn.Module, peft_config):
    """A copy of the peft LoraConfig that leaves the image encoder without adapters (`lora_exclusions`); one that
    names its own exclude_modules is kept as it is."""
    import copy

    if getattr(peft_config, "exclude_modules", None):
        return peft_config
    peft_config = copy.deepcopy(peft_config)
    peft_config.exclude_modules = lora_exclusions(lm)
    return peft_config


def trains_encoder(backbone: nn.Module) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for name, child in backbone.named_children()
                                           if name != "language_model" for p in child.parameters())


def image_token_id(model_config) -> int:
    return model_config.image_token_id


# ---- a prompt's images -------------------------------------------------------------------------------------


def check_inputs(inputs, where: str) -> None:
    """A prompt's processor outputs: a mapping with pixel_values (a tensor). One line naming `where` otherwise."""
    if not isinstance(inputs, Mapping) or not isinstance(inputs.get("pixel_values"), torch.Tensor):
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(f"{where}: expected the prompt's image processor outputs (a mapping with a pixel_values "
                         f"tensor, e.g. image_grid_thw beside it), got {got}")


def same_images(a: Mapping, b: Mapping) -> bool:
    """Two prompts' processor outputs hold the same images (the same object, or equal tensors): one encoder pass."""
    if a is b:
        return True
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def group_keys(prompt_ids: Sequence[Sequence[int]], images: Sequence[Optional[Mapping]]) -> list[Optional[int]]:
    """Per sample, the index of the first sample with the same prompt and images (its group's key); None where a
    sample has no images. Completions of a group share one processor-output object, so this is mostly `is`."""
    keys: list[Optional[int]] = []
    firsts: dict[tuple, list[int]] = {}
    for i, (ids, inputs) in enumerate(zip(prompt_ids, images, strict=True)):
        if inputs is None:
            keys.append(None)
            continue
        candidates = firsts.setdefault(tuple(ids), [])
        key = next((j for j in candidates if same_images(images[j], inputs)), None)
        if key is None:
            candidates.append(i)
            key = i
        keys.append(key)
    return keys


def prompt_positions(backbone: nn.Module, prompt_ids: Sequence[int], inputs: Mapping) -> tuple[torch.Tensor, int]:
    """M-RoPE: (positions [3, P] long, the prompt's rope delta) from the backbone's own `get_rope_index` over the
    prompt; a token at index t after the prompt sits at t + delta on all three axes (as in the model's generate)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    types = torch.zeros_like(ids, dtype=torch.int32).masked_fill(ids == image_token_id(backbone.config), 1)
    grids = {k: inputs[k] for k in ("image_grid_thw",) if k in inputs}
    positions, delta = backbone.get_rope_index(ids, mm_token_type_ids=types, **grids)
    return positions[:, 0], int(delta.reshape(-1)[0])


@dataclass
class RowImages:
    """The images of one packed row: each distinct prompt's processor outputs once (`inputs`, in row order), which of
    them each packed sequence shows (`of_sequence`, -1: a text-only sequence), and the rows (caller's sample indices)
    for messages."""

    inputs: list[Mapping]
    of_sequence: list[int]
    rows: list[int]
    placeholders: list[int]  # per distinct prompt: its image tokens, which its features must match

    @classmethod
    def of(cls, mb, prompt_ids, completion_ids, images: Sequence[Optional[Mapping]], keys, backbone: nn.Module
           ) -> "RowImages":
        """The row's images, and for M-RoPE backbones its `[4, 1, L]` positions written into `mb.position_ids`:
        text positions restarting per sequence, then each sequence's own 3-D positions (computed once per prompt)."""
        order: dict[int, int] = {}
        inputs, of_sequence, placeholders = [], [], []
        token = image_token_id(backbone.config)
        for i in mb.rows:
            if keys[i] is None:
                of_sequence.append(-1)
                continue
            if keys[i] not in order:
                check_inputs(images[i], f"images of sample {i}")
                order[keys[i]] = len(inputs)
                inputs.append(images[i])
                placeholders.append(sum(1 for t in prompt_ids[i] if t == token))
            of_sequence.append(order[keys[i]])
        row = cls(inputs, of_sequence, list(mb.rows), placeholders)
        if FAMILIES.get(backbone.config.model_type):
            mb.position_ids = row.mrope_positions(mb, prompt_ids, completion_ids, backbone)
        return row

    def mrope_positions(self, mb, prompt_ids, completion_ids, backbone) -> torch.Tensor:
        per_prompt: dict[int, tuple[torch.Tensor, int]] = {}
        parts = []
        for i, k in zip(self.rows, self.of_sequence, strict=True):
            prompt, length = prompt_ids[i], len(prompt_ids[i]) + len(completion_ids[i]) - 1
            if k < 0:  # a text-only sequence: its index on every axis
                parts.append(torch.arange(length).expand(3, -1))
                continue
            if k not in per_prompt:
                per_prompt[k] = prompt_positions(backbone, prompt, self.inputs[k])
            positions, delta = per_prompt[k]
            after = torch.arange(len(prompt), length) + delta
            parts.append(torch.cat([positions, after.expand(3, -1)], dim=1))
        mrope = torch.cat(parts, dim=1).to(mb.position_ids.device)
        return torch.cat([mb.position_ids[None], mrope[:, None]], dim=0)  # [4, 1, L]: text positions first


# ---- the encoder, once per prompt -------------------------------------------------------------------------------


def _encoder_arguments(backbone: nn.Module, inputs: Mapping, device, dtype) -> dict:
    """The processor outputs `get_image_features` names (pixel_values, image_grid_thw, image_sizes, ...), on the
    device, floating ones in the encoder's dtype."""
    named = inspect.signature(backbone.get_image_features).parameters
    out = {}
    for key, value in inputs.items():
        if key in TEXT_KEYS or key not in named:
            continue
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype) if value.is_floating_point() else value.to(device)
        out[key] = value
    return out


def encoder_outputs(backbone: nn.Module, row: RowImages) -> list:
    """One `get_image_features` call per distinct prompt of the row (no autograd where the encoder is frozen); each
    prompt's image-token count checked against its features (one line naming the sample, before the decoder)."""
    encoder = next(child for name, child in backbone.named_children() if name != "language_model")
    param = next(encoder.parameters())
    token = image_token_id(backbone.config)
    grad = trains_encoder(backbone)
    named = inspect.signature(backbone.get_image_features).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in named.values())
    returns_dict = {"return_dict": True} if "return_dict" in named or takes_kwargs else {}
    outs = []
    for k, inputs in enumerate(row.inputs):
        with torch.set_grad_enabled(grad):
            out = backbone.get_image_features(**_encoder_arguments(backbone, inputs, param.device, param.dtype),
                                              **returns_dict)
        if not hasattr(out, "pooler_output"):  # (releases before 5.19 may return the per-image features bare)
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            out = BaseModelOutputWithPooling(pooler_output=tuple(out))
        features = sum(f.shape[0] for f in out.pooler_output)
        if row.placeholders[k] != features:
            i = row.rows[row.of_sequence.index(k)]
            raise ValueError(f"sample {i}: its prompt has {row.placeholders[k]} image tokens (id {token}) but its images give "
                             f"{features} features: the prompt's image placeholders must be expanded by the same "
                             f"image processor settings (Qwen2-VL: image_grid_thw.prod() / merge_size**2 per image)")
        outs.append(out)
    return outs


def row_encoder_outputs(outputs: list, row: RowImages) -> Optional[dict]:
    """`mm_encoder_outputs` of the packed row: the per-image fields of each sequence's prompt, in row order, the
    prompt's tensors repeated (not copied) once per sequence that shows them. None: a row without images."""
    shown = [k for k in row.of_sequence if k >= 0]
    if not shown:
        return None
    fields = {}
    for name in PER_IMAGE_FIELDS:
        fields[name] = tuple(f for k in shown for f in getattr(outputs[k], name))
    for name in PER_LAYER_PER_IMAGE_FIELDS:
        layers = [getattr(o, name, None) for o in outputs]
        if any(x is not None for x in layers):
            depth = len(layers[shown[0]])
            fields[name] = [tuple(f for k in shown for f in layers[k][d]) for d in range(depth)]
    return {"image": type(outputs[0])(**fields)}


def takes_encoder_outputs(backbone: nn.Module) -> bool:
    """The backbone's forward takes precomputed encoder outputs (`mm_encoder_outputs`, transformers 5.19); older
    releases merge through `merged_embeddings` instead."""
    return "mm_encoder_outputs" in inspect.signature(backbone.forward).parameters


def merged_embeddings(backbone: nn.Module, input_ids: torch.Tensor, outputs: dict) -> torch.Tensor:
    """`inputs_embeds` with the row's image features written over its placeholders, in order (what the backbone's
    own forward does with `mm_encoder_outputs`): for a transformers without that argument. Deepstack features
    (Qwen3-VL) enter the decoder's layers and need the backbone's own merge: refused here."""
    image = outputs["image"]
    if getattr(image, "deepstack_features", None) is not None:
        raise ValueError(f"{type(backbone).__name__}: its deepstack image features need the backbone's own merge "
                         f"(mm_encoder_outputs, transformers >= 5.19); this transformers lacks it")
    embeds = backbone.get_input_embeddings()(input_ids)
    features = torch.cat(list(image.pooler_output)).to(embeds.dtype)
    return embeds.masked_scatter((input_ids == image_token_id(backbone.config))[..., None], features)


# ---- loading -----------------------------------------------------------------------------------------------------


def load_vision_language(path: str, dtype):
    """(model, tokenizer) of a VLM folder: `AutoModelForImageTextToText` (a VLM has no causal-LM class in transformers
    5.19) and its tokenizer (the image processor is the data's: grpo_fast.data)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer

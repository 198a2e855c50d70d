"""The processor of a vision-language model: chat template, image placeholders expanded, pixels.

A VLM's processor (transformers' `ProcessorMixin`) renders a prompt's messages with the chat template (an image part
becomes the model's placeholder, Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`), runs its image processor
on the prompt's images (`pixel_values`, and for the M-RoPE families `image_grid_thw`) and repeats each placeholder as
many times as the image has features. `load_processor` gives the model's own processor where transformers can build
it (Idefics3/SmolVLM, LLaVA, Gemma 3: their PIL image processors need no torchvision).

The Qwen2-VL / Qwen2.5-VL / Qwen3-VL processor classes cannot be built beside this CPU torch: their constructor checks
a video processor, and transformers' video processors import torchvision, which does not import here
(shared/ENVIRONMENT.md). For them `load_processor` builds `pil_qwen_processor`: transformers' own processor class of
the family with the video processor left out (images only), on the PIL image processor (`Qwen2VLImageProcessorPil`):
the placeholder is expanded by the library's own rule, `image_grid_thw.prod() / merge_size**2` tokens an image.
"""

from __future__ import annotations

import functools
import os

# model_type -> transformers' processor class of the family (images: the same placeholder rule)
QWEN_VL_PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
}


@functools.lru_cache(maxsize=None)
def _images_only(base_name: str) -> type:
    """`base_name`'s processor class without its video processor: the attributes ProcessorMixin reads from
    `__init__`'s signature are the image processor and the tokenizer alone, so nothing checks (or imports) a
    video processor; placeholder expansion, `__call__` and the chat template stay the library's."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, base_name)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # (as the family's own __init__ sets them; the video ones for code that reads them)
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        if base_name == "Qwen3VLProcessor":  # (its __init__ also names the vision markers)
            self.vision_start_token = getattr(tokenizer, "vision_start_token", "<|vision_start|>")
            self.vision_end_token = getattr(tokenizer, "vision_end_token", "<|vision_end|>")
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(f"Pil{base_name}", (base,), {"__init__": __init__, "__module__": __name__})


def pil_qwen_processor(model_type: str, image_processor, tokenizer, chat_template=None):
    """The Qwen-VL family's processor (images only) on a PIL image processor and a tokenizer."""
    if model_type not in QWEN_VL_PROCESSORS:
        raise ValueError(f"pil_qwen_processor: model_type {model_type!r} is not a Qwen-VL family "
                         f"({sorted(QWEN_VL_PROCESSORS)})")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return _images_only(QWEN_VL_PROCESSORS[model_type])(image_processor, tokenizer, chat_template=template)


def load_processor(path: str | os.PathLike, *, tokenizer=None):
    """The processor of the VLM in folder (or hub id) `path`: the family's PIL-only Qwen processor for the Qwen-VL
    types (`pil_qwen_processor`), else the model's own (`AutoProcessor`). tokenizer: use this one instead of the
    folder's."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    path = os.fspath(path)
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type in QWEN_VL_PROCESSORS:
        from transformers import Qwen2VLImageProcessorPil

        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        return pil_qwen_processor(model_type, Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer)
    kwargs = {"tokenizer": tokenizer} if tokenizer is not None else {}
    return AutoProcessor.from_pretrained(path, **kwargs)


def processor_for(model, tokenizer, model_path=None):
    """The processor of the run's VLM `model`: `tokenizer` where it is one (a processor passed as the tokenizer), else
    loaded from `model_path` or the folder the model was loaded from (`load_processor`, with the run's tokenizer). A
    model that is not a vision-language one is refused in one line."""
    if getattr(model.config, "vision_config", None) is None:
        raise ValueError(f"train_dataset has images but the model ({model.config.model_type}) is not a "
                         f"vision-language model; use a VLM (README, \"Vision-language models\") or drop the image column")
    if is_processor(tokenizer):
        return tokenizer
    path = model_path or getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path or not os.path.isdir(os.fspath(path)):
        raise ValueError(f"train_dataset has images: the model's processor is loaded from its folder, and the model "
                         f"{type(model).__name__} was not loaded from one (name_or_path={path!r}); pass the processor "
                         f"as tokenizer=")
    return load_processor(path, tokenizer=tokenizer)


def is_processor(processing_class) -> bool:
    """Whether `processing_class` is a multimodal processor (has an image processor), not a bare tokenizer."""
    from transformers.processing_utils import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin) and hasattr(processing_class, "image_processor")


def tokenizer_of(processing_class):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class

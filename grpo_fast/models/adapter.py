"""The two halves of a transformers causal LM that the fused path needs, kept apart.

A causal LM is `lm_head(decoder(input_ids))`. The fused ops take the decoder's final hidden states
and the lm_head weight, so the model is never called end to end: the `[tokens x vocab]` logits
never exist. This file finds the decoder and the head (through PEFT and accelerate wrappers),
runs the decoder, and turns hidden states into per-token log-probs with `masked_linear_logprobs`.
Both trainers use it: the native `GRPOTrainer` (train/forward.py) and the TRL adapter
(integrations/trl.py); it knows nothing of either.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import masked_linear_logprobs
from . import vision

# Config fields that make a model transform its logits after the lm_head (Gemma's soft-cap, Cohere's
# logit_scale, Granite's logits_scaling, ...): the fused ops apply them (`objective.LogitMap`), read as
# TRL 1.16's `add_fused_lm_head` reads them (`logit_transform`). Every field TRL lists is implemented.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside `model` (already unwrapped from DDP/accelerate).

    A PEFT model is looked through: its LoRA layers live inside the base model's modules, so running
    the base model's decoder still applies the adapter, and `disable_adapter()` (TRL's reference
    pass) still turns it off.
    """
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def decoder_of(lm: nn.Module) -> nn.Module:
    """The backbone that returns the final (normed) hidden states: `model.model` for Llama; for a vision-language
    model the fused path trains on images (models/vision.py), its multimodal backbone, which merges the image
    features into the language model's inputs."""
    if vision.supports_images(lm.config):
        return vision.backbone_of(lm)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    decoder = decoder if decoder is not None and decoder is not lm else getattr(lm, "base_model", None)
    if decoder is None or decoder is lm:
        raise ValueError(
            f"{type(lm).__name__} has no separate decoder (get_decoder() / base_model): the fused path needs "
            "the hidden states before the lm_head"
        )
    return decoder


def output_head(lm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] or None) of the lm_head; tied embeddings share the weight Parameter."""
    head = _module_in_use(lm.get_output_embeddings())
    if type(head) is not nn.Linear and not _fsdp_wrapped_linear(head):  # a PEFT head (LoRA) would lose its adapter
        raise ValueError(
            f"the lm_head must be a plain torch.nn.Linear for the fused loss, got {type(head).__name__}; "
            "remove 'lm_head' from the PEFT target_modules"
        )
    return head.weight, head.bias


def _module_in_use(head: nn.Module) -> nn.Module:
    """PEFT's `modules_to_save=["lm_head"]` wraps the head with a trained copy per adapter: the module its forward
    runs now (the active adapter's copy; the frozen original with adapters disabled, the KL reference's pass)."""
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:
        return head
    if not isinstance(head, ModulesToSaveWrapper):
        return head
    active = list(head.active_adapters)
    if head.disable_adapters or not active or any(name not in head.modules_to_save for name in active):
        return head.original_module
    return head.modules_to_save[active[0]]


def _fsdp_wrapped_linear(module: nn.Module) -> bool:
    """An nn.Linear that FSDP2's `fully_shard` made a unit of its own (its class becomes FSDPLinear)."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        return False
    return type(module).__bases__ == (FSDPModule, nn.Linear)


def unshard_head(head: nn.Module) -> None:
    """FSDP2 keeps an lm_head that is a unit of its own sharded outside its forward, which the fused
    loss never calls: unshard it explicitly. Its gradient then lands on the whole weight and FSDP2's
    end-of-backward reduce-scatters it into the shards, as for any parameter."""
    if _fsdp_wrapped_linear(head):
        head.unshard()


def logit_transform(model_config, name: str = "model") -> dict:
    """The model's own map of its lm_head output before sampling, as `LossOptions`/the ops take it:
    `{"logit_scale": s, "logit_softcap": c or None}` (logits -> c tanh(s logits / c), then the temperature).

    The fields as transformers' models use them and TRL 1.16 reads them: `final_logit_softcapping` (Gemma 2,
    Gemma 3's text model); a multiplier, the first set of `logit_scale` (Cohere, Cohere 2), `output_multiplier`,
    `lm_head_multiplier` (Falcon-H1); else `logits_scaling`, which Granite and MiniCPM3 divide by and
    HyperCLOVA X multiplies by. Checkable from config.json alone, before any weights load: a value the map
    cannot take (not a positive finite number) raises a ValueError naming the field."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config

    def positive(field):
        value = getattr(config, field, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"{name}: config.{field}={value!r} cannot scale the logits; expected a positive finite "
                             "number (or no value)")
        return value

    softcap = positive("final_logit_softcapping")
    scale = next((v for v in map(positive, ("logit_scale", "output_multiplier", "lm_head_multiplier")) if v is not None),
                 None)
    if scale is None and positive("logits_scaling") is not None:
        scale = config.logits_scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / config.logits_scaling
    return {"logit_scale": 1.0 if scale is None else float(scale),
            "logit_softcap": None if softcap is None else float(softcap)}


def check_fusable(lm: nn.Module, name: str = "model") -> None:
    """Raise a ValueError naming the reason when the fused path cannot reproduce `lm`'s logits."""
    logit_transform(lm.config, name)
    decoder_of(lm)
    output_head(lm)


def completion_hidden_states(lm: nn.Module, input_ids, attention_mask, logits_to_keep: int, **multimodal
                             ) -> torch.Tensor:
    """Final hidden states `[B, logits_to_keep, H]` at the positions that predict the last
    `logits_to_keep` tokens of `input_ids [B, L]`: positions L-1-logits_to_keep .. L-2 (the last
    prompt position predicts the first completion token). multimodal: a VLM's image inputs as its backbone takes
    them (pixel_values, image_grid_thw, mm_token_type_ids, ...: the processor's outputs)."""
    out = decoder_of(lm)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **multimodal)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, -logits_to_keep - 1 : -1]


def masked_logprobs(hidden, weight, bias, target_ids, mask, *, options, differentiable_entropy: bool = False):
    """Log-probs and entropies `[B, T]` (float32) of `target_ids` from `hidden [B, T, H]` under the loss
    options' logit map (`objective.LossOptions`: the temperature, the model's scale and soft-cap) and
    backend, computed only where `mask` is set and 0 elsewhere (as TRL returns them). Differentiable in logp
    (and in the entropy with `differentiable_entropy=True`: the entropy bonus)."""
    hidden = hidden.to(weight.dtype)  # autocast may hand back another dtype; the op wants one
    return masked_linear_logprobs(hidden, weight, target_ids, mask, bias=bias, temperature=options.temperature,
                                  logit_scale=options.logit_scale, logit_softcap=options.logit_softcap,
                                  backend=options.backend, return_entropy=True,
                                  differentiable_entropy=differentiable_entropy)

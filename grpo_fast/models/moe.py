"""Mixture-of-experts causal LMs: the router load-balancing loss the fused path adds, read off the model.

A transformers MoE causal LM computes its load-balancing ("aux") loss in its ForCausalLM forward, from the
decoder's router logits. The fused path never calls that forward (the decoder, then the fused op on the
lm_head weight), so it asks the decoder for its router logits (`output_router_logits=True`) and computes the
loss itself (`objective.load_balancing_loss`). This module says whether a model has that loss and with what
coefficient (TRL 1.16's rule, `router_aux_loss_coef`), which families' loss is the one computed there, and
runs the decoder for it. Both trainers use it: the native one (train/step.py) and the TRL adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .. import objective
from ..distributed import gather_objects, sum_over_ranks
from .adapter import completion_hidden_states, decoder_of

# Model types whose causal LM (transformers 5.19) adds the Switch loss that `objective.load_balancing_loss`
# computes: the same `load_balancing_loss_func`, called with (router logits, num_experts, num_experts_per_tok,
# attention_mask) (tests/models/test_moe.py compares the installed sources). Tested against the model's own
# value: qwen3_moe, gpt_oss, mixtral, olmoe, qwen2_moe. Others with a router loss (dbrx, jetmoe, doge, the
# VLMs') define it otherwise and are refused while it is on; GLM4-MoE and DeepSeek-V3 declare no coefficient
# (no router loss: they train without one).
SWITCH_LOSS_MODEL_TYPES = (
    "qwen3_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_next", "phimoe", "minimax", "minimax_m2",
    "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid", "jamba", "ernie4_5_moe", "flex_olmo",
    "deepseek_v4", "laguna", "mellum",
)


@dataclass(frozen=True)
class RouterLoss:
    """The router load-balancing loss a model trains with: its weight in the loss and the Switch loss's
    shape (the model's own `num_experts`, `num_experts_per_tok`)."""

    coef: float
    num_experts: int
    top_k: int


def _text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def router_aux_loss_coef(model_config, coef: Optional[float], name: str = "model") -> float:
    """The router loss's coefficient in effect, 0.0 when off, by TRL 1.16's rule: `coef` when given, else the
    model config's `router_aux_loss_coef` (0.0 when it declares none); on only for a model whose config has
    `output_router_logits` (whatever its value: it says the model can return router logits). A non-zero `coef`
    for a model without them raises (as TRL does), before any weights load: checkable from config.json."""
    text = _text_config(model_config)
    moe = hasattr(text, "output_router_logits")
    if coef and not moe:
        raise ValueError(f"router_aux_loss_coef={coef} but {name} ({getattr(text, 'model_type', '?')}) is not a "
                         "mixture-of-experts model that returns router logits: there is no router loss to weight; "
                         "leave router_aux_loss_coef unset")
    value = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    return float(value or 0.0) if moe else 0.0


def router_loss(lm: nn.Module, coef: Optional[float], name: str = "model") -> Optional[RouterLoss]:
    """The router loss `lm` (a transformers causal LM, unwrapped) trains with, or None (a dense model, a
    coefficient of 0, an MoE whose config declares none). Raises a ValueError naming the model type when it is
    on for a family whose router loss is not the Switch loss computed here (`SWITCH_LOSS_MODEL_TYPES`)."""
    value = router_aux_loss_coef(lm.config, coef, name)
    if value == 0.0:
        return None
    text = _text_config(lm.config)
    model_type = getattr(text, "model_type", None)
    if model_type not in SWITCH_LOSS_MODEL_TYPES:
        raise ValueError(f"{name}: router_aux_loss_coef={value} but the router loss of model type {model_type!r} is "
                         "not the Switch loss the fused path computes (or not checked against it); set "
                         "router_aux_loss_coef=0.0 to train without it, or use trl.GRPOTrainer")
    num_experts = getattr(lm, "num_experts", None) or getattr(text, "num_experts", None)
    top_k = getattr(lm, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        raise ValueError(f"{name}: {model_type} declares no num_experts / num_experts_per_tok for its router loss")
    return RouterLoss(float(value), int(num_experts), int(top_k))


def router_logits_of(outputs) -> tuple[torch.Tensor, ...]:
    """The decoder output's router logits (one [tokens, experts] tensor per MoE layer), checked present."""
    logits = getattr(outputs, "router_logits", None)
    if not logits:
        raise RuntimeError(f"the decoder returned no router logits ({type(outputs).__name__}) although asked with "
                           "output_router_logits=True: the router loss cannot be computed")
    return tuple(logits)


def completion_hidden_and_router_loss(lm: nn.Module, input_ids, attention_mask, logits_to_keep: int,
                                      router: Optional[RouterLoss]):
    """`adapter.completion_hidden_states` `[B, logits_to_keep, H]` and, with `router`, the Switch loss of the same
    decoder forward's router logits over the real tokens of `attention_mask [B, L]` (TRL's padded rows: the
    value the causal LM's own forward returns as `aux_loss`); None without `router`."""
    if router is None:
        return completion_hidden_states(lm, input_ids, attention_mask, logits_to_keep), None
    out = decoder_of(lm)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_router_logits=True)
    with torch.autocast(input_ids.device.type, enabled=False):  # (the loss in float32 whatever the forward's autocast)
        aux = objective.load_balancing_loss(router_logits_of(out), router.num_experts, router.top_k,
                                            attention_mask.reshape(-1))
    return out.last_hidden_state[:, -logits_to_keep - 1 : -1], aux


class RouterStats:
    """The router loss's metrics of an optimizer step, over all ranks: `aux_loss` (TRL's name: the mean over
    every forward of its Switch loss, without the coefficient) and `moe/max_expert_load` (the experts' top-k
    assignments of the step counted per layer: `objective.max_expert_load`)."""

    def __init__(self):
        self.aux, self.count, self.assignments = 0.0, 0, None

    def add(self, aux: torch.Tensor, assignments: torch.Tensor) -> None:
        """One forward's `objective.load_balancing_loss(..., return_assignments=True)`."""
        self.aux += float(aux.detach())
        self.count += 1
        self.assignments = assignments if self.assignments is None else self.assignments + assignments

    def metrics(self, world) -> dict:
        """(a collective: every rank calls it)"""
        aux, count = sum_over_ranks([self.aux, float(self.count)], world)
        mine = None if self.assignments is None else self.assignments.double().cpu()
        every = [a for a in gather_objects(mine, world) if a is not None]  # a rank may have had no micro-batch
        return {"aux_loss": aux / count if count else float("nan"),
                "moe/max_expert_load": objective.max_expert_load(sum(every)) if every else float("nan")}

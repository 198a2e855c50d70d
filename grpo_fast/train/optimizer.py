"""The optimizer and its learning-rate schedule, built once: AdamW over the trainable parameters (with LoRA, the
adapter's), warm-up then constant, linear or cosine decay to max_steps (TRL's names and semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..bounds import FINITE_AT_LEAST_0, INTEGER_AT_LEAST_0, Bounds
from ..options import mirror, option, options_record

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")  # lr_scheduler_type's choices


@options_record
@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW's and the schedule's options (declared here: GRPOConfig takes them), and the run's length."""

    learning_rate: float = option(1e-5, "AdamW peak learning rate.", bounds=FINITE_AT_LEAST_0)
    adam_beta1: float = option(0.9, "AdamW beta1.", bounds=Bounds(low=0, high=1, high_open=True))
    adam_beta2: float = option(0.99, "AdamW beta2.", bounds=Bounds(low=0, high=1, high_open=True))
    adam_epsilon: float = option(1e-8, "AdamW epsilon.", bounds=Bounds(low=0))
    weight_decay: float = option(0.0, "AdamW weight decay.", bounds=Bounds(low=0))
    lr_scheduler_type: str = option("constant_with_warmup", "Learning-rate schedule after warm-up.", LR_SCHEDULERS)
    warmup_steps: int = option(0, "Linear warm-up steps (takes precedence over warmup_ratio when > 0).", bounds=INTEGER_AT_LEAST_0)
    warmup_ratio: float = option(0.0, "Warm-up as a fraction of max_steps.", bounds=Bounds(low=0, high=1))
    max_steps: int = mirror(20)  # the schedule's length


def build_optimizer(model, options: OptimizerOptions) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=options.learning_rate, betas=(options.adam_beta1, options.adam_beta2),
                             eps=options.adam_epsilon, weight_decay=options.weight_decay)


def build_scheduler(optimizer, options: OptimizerOptions) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = options.warmup_steps or math.ceil(options.warmup_ratio * options.max_steps)
    kind, total = options.lr_scheduler_type, options.max_steps

    def factor(step: int) -> float:
        if kind != "constant" and step < warmup:
            return (step + 1) / (warmup + 1)
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

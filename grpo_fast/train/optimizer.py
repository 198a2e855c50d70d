"""The optimizer and its learning-rate schedule, built once: AdamW over the trainable parameters (with LoRA, the
adapter's), warm-up then constant, linear or cosine decay to max_steps (TRL's names and semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..options import mirror, options_record


@options_record
@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW's and the schedule's options (GRPOConfig's fields of the same names)."""

    learning_rate: float = mirror(1e-5)
    adam_beta1: float = mirror(0.9)
    adam_beta2: float = mirror(0.99)
    adam_epsilon: float = mirror(1e-8)
    weight_decay: float = mirror(0.0)
    lr_scheduler_type: str = mirror("constant_with_warmup")
    warmup_steps: int = mirror(0)
    warmup_ratio: float = mirror(0.0)
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

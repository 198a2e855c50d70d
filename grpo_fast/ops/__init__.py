"""Public differentiable ops: fused linear -> log-prob and fused linear -> GRPO loss."""

from .backends import BACKENDS
from .grpo_loss import fused_linear_grpo_loss
from .linear_logprobs import fused_linear_logprobs

__all__ = ["BACKENDS", "fused_linear_grpo_loss", "fused_linear_logprobs"]

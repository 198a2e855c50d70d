"""grpo_fast: fast, lean GRPO training for language models.

Light to import: the native extension, Triton, vLLM and transformers load only where used.
"""

from .objective import LossOptions, group_advantages, grpo_loss_from_logprobs, grpo_loss_reference
from .ops import fused_linear_grpo_loss, fused_linear_logprobs, masked_linear_logprobs

__version__ = "0.1.0"

__all__ = [
    "LossOptions",
    "group_advantages",
    "grpo_loss_reference",
    "grpo_loss_from_logprobs",
    "fused_linear_logprobs",
    "masked_linear_logprobs",
    "fused_linear_grpo_loss",
]

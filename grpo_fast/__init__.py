"""grpo_fast: fast, lean GRPO training for language models.

Light to import: the native extension, Triton, vLLM and transformers load only where used.
"""

from .objective import (
    LossOptions,
    decaying_serial_rewards,
    difficulty_weights,
    group_advantages,
    grpo_loss_from_logprobs,
    grpo_loss_reference,
    lead_length_rewards,
    noise_aware_weights,
    partial_credit_rewards,
    thought_answer_advantages,
)
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
    # GRPO variants (reward shaping, advantages): see grpo_fast.objective
    "lead_length_rewards",
    "difficulty_weights",
    "noise_aware_weights",
    "decaying_serial_rewards",
    "thought_answer_advantages",
    "partial_credit_rewards",
]

"""Reward functions with TRL's signature ``f(prompts, completions, completion_ids, **columns)``.

Light to import: math-verify loads on the first math reward call.
"""

from .extract import completion_text, final_answer
from .names import BUILTIN_REWARDS, get_reward_funcs, reward_name
from .steps import chain_steps
from .verifiable import (
    LeadReward,
    LengthAwareMathReward,
    boxed_math_reward,
    format_reward,
    is_correct,
    math_reward,
    overlong_penalty,
)

__all__ = [
    "BUILTIN_REWARDS",
    "LeadReward",
    "LengthAwareMathReward",
    "chain_steps",
    "completion_text",
    "final_answer",
    "format_reward",
    "boxed_math_reward",
    "get_reward_funcs",
    "is_correct",
    "math_reward",
    "overlong_penalty",
    "reward_name",
]

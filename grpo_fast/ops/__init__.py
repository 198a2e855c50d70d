"""Public differentiable ops: fused linear -> log-prob and fused linear -> GRPO loss.

Both are registered custom ops (`torch.ops.grpo_fast.*`), so `torch.compile(fullgraph=True)` traces
through a function that calls them without a graph break.
"""

from .backends import BACKENDS
from .grpo_loss import fused_linear_grpo_loss
from .linear_logprobs import fused_linear_logprobs, masked_linear_logprobs

__all__ = ["BACKENDS", "fused_linear_grpo_loss", "fused_linear_logprobs", "masked_linear_logprobs"]

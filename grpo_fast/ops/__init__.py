"""Public differentiable ops: fused linear -> log-prob and fused linear -> GRPO loss (both over truncated
sampling's kept sets too); `linear_topk`, each token's largest logits without the logits (no gradient).

The two differentiable ops are registered custom ops (`torch.ops.grpo_fast.*`), so `torch.compile(fullgraph=True)` traces
through a function that calls them without a graph break.
"""

from .backends import BACKENDS
from .grpo_loss import fused_linear_grpo_loss
from .linear_logprobs import fused_linear_logprobs, masked_linear_logprobs
from .topk import LinearTopK, linear_topk

__all__ = ["BACKENDS", "LinearTopK", "fused_linear_grpo_loss", "fused_linear_logprobs", "linear_topk",
           "masked_linear_logprobs"]

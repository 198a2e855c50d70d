"""The chunk driver of every backend's gradient pass (`torch`, `cpu` and `triton`).

A gradient pass walks the tokens in chunks of C rows. Each chunk yields a `[C, V]` slab holding
d(loss)/d(logits) of its rows (how is the backend's business: a matmul and a C++ row pass, or a
Triton kernel); this file owns the rest, once for all backends:

- how many rows a chunk holds: a memory budget for the slab, which each backend sets
  (`row_ops.SLAB_BYTES` for the CPU backends, `kernels.linear_logprobs.workspace_bytes` on a GPU);
- the gradient matmuls `grad_hidden = slab @ W`, `grad_weight += slab.T @ hidden`, `grad_bias += sum(slab)`;
- the accumulation rule of the parameter gradients across chunks (below, `ParamGrads`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def plan(n: int, vocab: int, bytes_per_logit: int, *, budget: int, min_rows: int = 1, balanced: bool = False,
         chunk_size: Optional[int] = None) -> tuple[int, list[tuple[int, int]]]:
    """(rows of the slab, [(start, end)] chunks) for `n` rows of `vocab` logits.

    Rows per chunk: `chunk_size` when given (tests), else as many as fit `budget` bytes, at least
    `min_rows`. balanced=True cuts rows that need several slabs into chunks of equal size (20000
    rows as 2 x 10000, not 14128 + 5872: a small tail runs the matmuls at a low rate); otherwise the
    last chunk is what is left.
    """
    step = chunk_size or max(min_rows, budget // (vocab * bytes_per_logit))
    step = max(1, min(n, step))
    if balanced and not chunk_size and n > step:
        step = -(-n // -(-n // step))
    return step, [(s, min(n, s + step)) for s in range(0, n, step)]


class ParamGrads:
    """The gradients w.r.t. (hidden [N, H], weight [V, H], bias [V]), filled chunk by chunk.

    grad_hidden rows are written once per chunk. grad_weight and grad_bias are sums over chunks,
    kept in float32 whatever the parameter's dtype (bf16 running sums lose the small chunks), except
    where the parameter's own dtype is exact: float32 parameters, and a single chunk whose slab is in
    the parameter's dtype (cuBLAS / oneDNN accumulate the product in float32 and round once; on an
    H200 that spares the float32 [V, H] buffer and its casts, ~5 ms of 110 at H=3584).
    """

    def __init__(self, hidden, weight, bias, needs: Sequence[bool], *, single_chunk: bool, slab_dtype: torch.dtype):
        need_h, need_w, need_b = needs
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.grad_hidden = torch.empty_like(hidden) if need_h else None
        exact = weight.dtype == torch.float32 or (single_chunk and slab_dtype == weight.dtype)
        self.grad_weight = None
        if need_w:
            self.grad_weight = torch.zeros(weight.shape, dtype=weight.dtype if exact else torch.float32,
                                           device=weight.device)
        self.grad_bias = None
        if need_b and bias is not None:
            self.grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)

    def add(self, start: int, end: int, grad_logits: torch.Tensor) -> None:
        """Add the chunk of rows [start, end), given its gradient slab `grad_logits [C, V]`."""
        hidden_c = self.hidden[start:end]
        if self.grad_hidden is not None:
            if grad_logits.dtype == self.weight.dtype:
                torch.mm(grad_logits, self.weight, out=self.grad_hidden[start:end])
            else:  # a float32 slab of low-precision parameters (the torch backend widens them)
                self.grad_hidden[start:end].copy_(grad_logits.to(self.weight.dtype) @ self.weight)
        if self.grad_weight is not None:
            if self.grad_weight.dtype == grad_logits.dtype:
                self.grad_weight.addmm_(grad_logits.t(), hidden_c.to(grad_logits.dtype))
            else:  # a bf16 slab: the chunk's product in bf16 (float32 inside the matmul), summed in float32
                self.grad_weight += grad_logits.t() @ hidden_c
        if self.grad_bias is not None:
            self.grad_bias += grad_logits.sum(0, dtype=torch.float32)

    def result(self):
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes; None where not wanted."""
        grad_weight = None if self.grad_weight is None else self.grad_weight.to(self.weight.dtype)
        grad_bias = None if self.grad_bias is None else self.grad_bias.to(self.bias.dtype)
        return self.grad_hidden, grad_weight, grad_bias


def param_grads(hidden, weight, bias, needs: Sequence[bool], chunks: Sequence[tuple[int, int]],
                slab_dtype: torch.dtype, chunk_grad: Callable[[int, int], torch.Tensor]):
    """Run `chunk_grad(start, end) -> [C, V] slab` over `chunks` and sum what the slabs give:
    (grad_hidden [N, H], grad_weight [V, H], grad_bias [V]); None where `needs` says not wanted.
    `slab_dtype`: the dtype `chunk_grad` returns (it decides the accumulation, see ParamGrads)."""
    grads = ParamGrads(hidden, weight, bias, needs, single_chunk=len(chunks) <= 1, slab_dtype=slab_dtype)
    for start, end in chunks:
        grads.add(start, end, chunk_grad(start, end))
    return grads.result()

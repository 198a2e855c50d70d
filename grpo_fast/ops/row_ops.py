"""The `torch` and `cpu` backends: token chunks, a matmul for the logits, row passes.

For each chunk of C tokens: `logits = hidden_c @ weight.T` (one matmul into a bounded `[C, V]`
slab), a row pass (log-sum-exp, target log-prob, entropy), and for gradients a second row pass
that overwrites the slab in place with `g * (onehot - softmax) / temperature` (times the slope of
the model's logit map, `objective.LogitMap`, when it scales or soft-caps); the chunk driver
(`chunk_driver.py`, shared with the Triton backend) turns the slabs into parameter gradients. Memory is
O(C * V) whatever N is. The backends differ only in the row passes (`RowOps`): PyTorch ops for
`torch`, one vectorised OpenMP C++ pass for `cpu`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import chunk_driver

# Slab budget: 32 MiB of logits (256 fp32 rows at V = 32768). Bounded memory is the point, but a
# chunk is also the K of the grad_weight update and the M of the other two matmuls: measured
# single-threaded on the 2-core dev CPU (N=2048, H=512, V=32768, fp32) the fused pass took 1.24x
# the matmul floor at 16 MiB, 1.15x at 32 MiB and 1.15x at 64 MiB. At 32 MiB grpo_fast's extra
# peak there is ~123 MB (slab + the gradients themselves + matmul scratch): 0.11x plain PyTorch's.
SLAB_BYTES = 32 << 20
# ...but at least 128 rows: at V = 151936 (fp32) 32 MiB is only 55 rows, and the fused pass took
# 1.67x the floor there against 1.16x at 128 rows (N=512, H=896, 2 threads); the slab (78 MB)
# stays small next to the [V, H] weight gradient it comes with (544 MB).
MIN_ROWS = 128


@dataclass(frozen=True)
class RowOps:
    # (logits [C, V], target [C], logit_map) -> (logp, entropy, lse), each [C] f32, of z = logit_map(logits)
    stats: Callable
    # in place: logits [C, V] <- [g (onehot - p) - g_entropy p (log p + H)] dz/dr, p = softmax(z),
    # z = logit_map(logits) (dz/dr = 1 / T without scale or soft-cap); lse, g [C] f32; g_entropy and
    # entropy H [C] f32 or both None (no entropy gradient: g (onehot - p) dz/dr)
    grad_: Callable
    # logit dtypes the passes take as they are (accumulating in f32 inside); any other dtype is
    # widened to a float32 copy of the chunk first
    slab_dtypes: tuple = (torch.float32,)


def torch_stats(logits, target, logit_map):
    z = logit_map(logits)
    m = z.amax(dim=-1, keepdim=True)
    shifted = z - m  # entropy from shifted logits: lse - E[z] would cancel (5e-6 off at |z| ~ 10)
    e = shifted.exp()
    s = e.sum(-1)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    logp_target = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1) - log_s
    entropy = log_s - (e * shifted).sum(-1) / s
    return logp_target, entropy, lse


def torch_grad_(logits, target, lse, g, logit_map, g_entropy=None, entropy=None):
    slope = logit_map.pre  # dz/dr of the logit map: a number, or one per logit with soft-capping
    if logit_map.softcap is None:
        logits.mul_(slope)
    else:
        logits.copy_(logit_map(logits))
        post = logit_map.post  # dz/dr = pre post (1 - tanh^2) = pre (post - z) (post + z) / post
        slope = (post - logits).mul_(logits + post).mul_(logit_map.pre / post)
    logits.sub_(lse.unsqueeze(-1))  # log p
    g = g.unsqueeze(-1)
    if g_entropy is None:
        logits.exp_().mul_(-g)  # -g p
    else:  # dH/dz = -p (log p + H): one [C, V] temporary for p (this backend is the plain one)
        p = logits.exp()
        logits.add_(entropy.unsqueeze(-1)).mul_(g_entropy.unsqueeze(-1)).add_(g).mul_(p).neg_()
    logits.scatter_add_(-1, target.unsqueeze(-1), g)  # + g onehot
    return logits.mul_(slope)


TORCH_ROW_OPS = RowOps(stats=torch_stats, grad_=torch_grad_)


def chunk_rows(n: int, vocab: int, chunk_size: Optional[int] = None, itemsize: int = 4) -> int:
    """Rows per chunk: `chunk_size`, or as many as fit SLAB_BYTES of logits of `itemsize` bytes
    (at least MIN_ROWS)."""
    return _plan(n, vocab, chunk_size, itemsize)[0]


def _plan(n, vocab, chunk_size, itemsize):
    # the module's constants are read at each call (tests shrink them to force many chunks)
    return chunk_driver.plan(n, vocab, itemsize, budget=SLAB_BYTES, min_rows=MIN_ROWS, chunk_size=chunk_size)


def _logits(slab, hidden_c, weight, bias, row_ops: RowOps):
    """Logits of one chunk, `[C, V]`, written into the reused `slab` (no allocation per chunk)."""
    out = slab[: hidden_c.shape[0]]
    if bias is None:
        torch.mm(hidden_c, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_c, weight.t(), out=out)
    return out if out.dtype in row_ops.slab_dtypes else out.float()


def forward(row_ops: RowOps, hidden, weight, bias, target, logit_map, chunk_size=None):
    """Per-token (logp, entropy, lse), each [N] f32, without a [N, V] tensor."""
    n, vocab = hidden.shape[0], weight.shape[0]
    logp = hidden.new_empty(n, dtype=torch.float32)
    entropy = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    step, spans = _plan(n, vocab, chunk_size, weight.element_size())
    slab = weight.new_empty(step, vocab)
    for s, e in spans:
        logits = _logits(slab, hidden[s:e], weight, bias, row_ops)
        logp[s:e], entropy[s:e], lse[s:e] = row_ops.stats(logits, target[s:e], logit_map)
    return logp, entropy, lse


def backward(row_ops: RowOps, hidden, weight, bias, target, lse, grad_logp, logit_map, needs=(True, True, True),
             chunk_size=None, grad_entropy=None, entropy=None):
    """Gradients of sum(grad_logp * logp + grad_entropy * entropy) w.r.t. (hidden, weight, bias),
    recomputing logit chunks; grad_entropy and the forward's entropy [N] f32, or None."""
    return _grad_pass(row_ops, hidden, weight, bias, target, logit_map, needs, chunk_size, lse=lse,
                      grad_logp=grad_logp, grad_entropy=grad_entropy, entropy=entropy)[2:]


def fused(row_ops: RowOps, hidden, weight, bias, target, logit_map, dloss_dlogp, needs=(True, True, True),
          chunk_size=None, grad_entropy=None):
    """One pass: (logp, entropy, grad_hidden, grad_weight, grad_bias).

    `dloss_dlogp(start, end, logp_chunk) -> g_chunk` gives the loss gradient for the chunk's tokens
    as soon as their log-probs are known (valid when the loss is local per token), so the logits
    are computed once, not recomputed in a backward pass. grad_entropy: d(loss)/d(entropy) [N] f32
    (the entropy bonus: a constant per token), or None.
    """
    return _grad_pass(row_ops, hidden, weight, bias, target, logit_map, needs, chunk_size, dloss_dlogp=dloss_dlogp,
                      grad_entropy=grad_entropy)


def _grad_pass(row_ops, hidden, weight, bias, target, logit_map, needs, chunk_size, lse=None, grad_logp=None,
               dloss_dlogp=None, grad_entropy=None, entropy=None):
    n, vocab = hidden.shape[0], weight.shape[0]
    logp = None  # entropy: the forward's (backward) or filled here (fused)
    if dloss_dlogp is not None:
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = torch.empty_like(logp)
    step, spans = _plan(n, vocab, chunk_size, weight.element_size())
    slab = weight.new_empty(step, vocab)

    def chunk_grad(s, e):  # the chunk's [C, V] gradient slab, written over its logits
        logits = _logits(slab, hidden[s:e], weight, bias, row_ops)
        if dloss_dlogp is not None:
            logp[s:e], entropy[s:e], lse_c = row_ops.stats(logits, target[s:e], logit_map)
            g = dloss_dlogp(s, e, logp[s:e]).float()
        else:
            lse_c, g = lse[s:e], grad_logp[s:e].float()
        if grad_entropy is None:
            return row_ops.grad_(logits, target[s:e], lse_c, g, logit_map)
        return row_ops.grad_(logits, target[s:e], lse_c, g, logit_map, grad_entropy[s:e].float(), entropy[s:e].float())

    slab_dtype = weight.dtype if weight.dtype in row_ops.slab_dtypes else torch.float32
    grads = chunk_driver.param_grads(hidden, weight, bias, needs, spans, slab_dtype, chunk_grad)
    return (logp, entropy, *grads)

"""The kept-set route of the fused ops: the log-softmax over each position's kept set (truncated sampling).

A position n with kept set S_n (`objective.KeptSets`) has logits only for its kept ids:

    r_j = h_n . W_j + b_j   (j in S_n: the gathered lm_head rows)      z = LogitMap(r)
    log p_j = z_j - logsumexp_{S_n}(z)                                  entropy over S_n

O(k H) per position, the logits a CSR buffer `[K]` beside the kept ids (never `[N, V]`). Gradients:
dr_j = [g (onehot - p_j) - g_h p_j (log p_j + H)] dz/dr, then grad_hidden_n = sum_j dr_j W_j,
grad_weight_j += dr_j h_n, grad_bias_j += dr_j: the kept rows only.

A backend's route is a `KeptOps` (four steps per chunk of positions: logits, row stats, in-place row
gradient, the scatter into parameter gradients); this file owns the chunks, once for the `torch` and
`cpu` backends (Triton has its own per-token kernels), and `Routes`, which splits a call's positions
into the full-vocabulary route (empty sets) and this one. Every function's rows all have non-empty sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..objective import KeptSets

# Memory of one chunk's gathered rows in the `torch` route ([entries, H] float32 a few times over) and of
# the `cpu` route's per-thread grad_hidden buffers: the slab budget of the full-vocabulary route (row_ops).
CHUNK_BYTES = 32 << 20


@dataclass
class KeptChunk:
    """Positions [start, end) of a kept-route call, their entries local to the chunk."""

    start: int
    end: int
    ids: Tensor  # [Kc] int64, the kept ids, CSR over the chunk's positions
    offsets: Tensor  # [C + 1] int64, from 0
    rows: Tensor  # [Kc] int64, the chunk row of each entry
    target_entry: Tensor  # [C] int64, the entry (index into ids) of each row's target
    by_id: Optional[tuple] = None  # a backend's grouping of the entries by id, kept from logits to scatter

    @property
    def target_local(self) -> Tensor:
        """[C] int64: each row's target as an index inside the row."""
        return self.target_entry - self.offsets[:-1]


@dataclass(frozen=True)
class KeptOps:
    # (hidden_c [C, H], weight, bias, chunk) -> r [Kc] f32: the chunk's kept logits before the map
    logits: Callable
    # (r [Kc], chunk, logit_map) -> (logp, entropy, lse), each [C] f32, over each row's set
    stats: Callable
    # in place: r [Kc] <- dr = [g (onehot - p) - g_h p (log p + H)] dz/dr; (r, chunk, lse, g, logit_map,
    # g_entropy, entropy), the last two [C] f32 or both None
    grad_: Callable
    # (dr [Kc], hidden_c, weight, chunk, grads: KeptGrads): adds the chunk's parameter gradients
    scatter: Callable
    # (H, threads) -> the most entries and rows a chunk may hold within CHUNK_BYTES
    chunk_limits: Callable


class KeptGrads:
    """(grad_hidden [N, H], grad_weight [V, H], grad_bias [V]) filled chunk by chunk: grad_hidden rows
    written once, the parameter gradients summed in float32 (in the weight's dtype when it is float32)."""

    def __init__(self, hidden, weight, bias, needs):
        need_h, need_w, need_b = needs
        self.hidden, self.weight, self.bias = hidden, weight, bias
        f32 = dict(dtype=torch.float32, device=weight.device)
        self.grad_hidden = torch.empty(hidden.shape, **f32) if need_h else None
        self.grad_weight = torch.zeros(weight.shape, **f32) if need_w else None
        self.grad_bias = torch.zeros(weight.shape[0], **f32) if need_b and bias is not None else None

    def result(self):
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(self.grad_hidden, self.hidden), cast(self.grad_weight, self.weight), cast(self.grad_bias, self.bias)


def chunks(kept: KeptSets, target: Tensor, max_entries: int, max_rows: int) -> list[KeptChunk]:
    """The positions of `kept` (all non-empty) in chunks of at most `max_entries` entries (a position's
    whole set, however large, is one chunk's at least) and `max_rows` rows."""
    offsets_host = kept.offsets.cpu()
    n = offsets_host.numel() - 1
    out, start = [], 0
    while start < n:
        end = int(torch.searchsorted(offsets_host, offsets_host[start] + max_entries, right=True)) - 1
        end = min(max(end, start + 1), start + max_rows, n)
        lo, hi = int(offsets_host[start]), int(offsets_host[end])
        offsets = kept.offsets[start:end + 1] - lo
        ids = kept.ids[lo:hi]
        rows = torch.repeat_interleave(torch.arange(end - start, device=ids.device), offsets.diff(), output_size=hi - lo)
        hit = (ids == target[start:end].index_select(0, rows)).nonzero().squeeze(-1)
        target_entry = torch.empty(end - start, dtype=torch.int64, device=ids.device)
        target_entry[rows.index_select(0, hit)] = hit  # (checked before: exactly one hit a row)
        out.append(KeptChunk(start, end, ids, offsets, rows, target_entry))
        start = end
    return out


def _chunks_for(ops: KeptOps, hidden, kept, target):
    max_entries, max_rows = ops.chunk_limits(hidden.shape[1], torch.get_num_threads())
    return chunks(kept, target, max_entries, max_rows)


def forward(ops: KeptOps, hidden, weight, bias, target, kept: KeptSets, logit_map):
    """Per-position (logp, entropy, lse), each [N] f32, over the kept sets."""
    n = hidden.shape[0]
    logp, entropy, lse = (hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
    for c in _chunks_for(ops, hidden, kept, target):
        r = ops.logits(hidden[c.start:c.end], weight, bias, c)
        logp[c.start:c.end], entropy[c.start:c.end], lse[c.start:c.end] = ops.stats(r, c, logit_map)
    return logp, entropy, lse


def backward(ops: KeptOps, hidden, weight, bias, target, kept: KeptSets, lse, grad_logp, logit_map,
             needs=(True, True, True), grad_entropy=None, entropy=None):
    """Gradients of sum(grad_logp * logp [+ grad_entropy * entropy]) w.r.t. (hidden, weight, bias),
    recomputing the kept logits; None where `needs` says not wanted."""
    return _grad_pass(ops, hidden, weight, bias, target, kept, logit_map, needs, lse=lse, grad_logp=grad_logp,
                      grad_entropy=grad_entropy, entropy=entropy)[2:]


def fused(ops: KeptOps, hidden, weight, bias, target, kept: KeptSets, logit_map, dloss_dlogp, needs=(True, True, True),
          grad_entropy=None):
    """(logp, entropy, grad_hidden, grad_weight, grad_bias) in one pass; `dloss_dlogp(start, end, logp_chunk)`
    as in `row_ops.fused`."""
    return _grad_pass(ops, hidden, weight, bias, target, kept, logit_map, needs, dloss_dlogp=dloss_dlogp,
                      grad_entropy=grad_entropy)


def _grad_pass(ops, hidden, weight, bias, target, kept, logit_map, needs, lse=None, grad_logp=None, dloss_dlogp=None,
               grad_entropy=None, entropy=None):
    n = hidden.shape[0]
    logp = None
    if dloss_dlogp is not None:
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = torch.empty_like(logp)
    grads = KeptGrads(hidden, weight, bias, needs)
    for c in _chunks_for(ops, hidden, kept, target):
        s, e = c.start, c.end
        r = ops.logits(hidden[s:e], weight, bias, c)
        if dloss_dlogp is not None:
            logp[s:e], entropy[s:e], lse_c = ops.stats(r, c, logit_map)
            g = dloss_dlogp(s, e, logp[s:e]).float()
        else:
            lse_c, g = lse[s:e].float(), grad_logp[s:e].float()
        entropy_args = (None, None) if grad_entropy is None else (grad_entropy[s:e].float(), entropy[s:e].float())
        ops.grad_(r, c, lse_c, g, logit_map, *entropy_args)
        if any(needs):
            ops.scatter(r, hidden[s:e], weight, c, grads)
    return (logp, entropy, *grads.result())


# ----------------------------------------------------------------------------------------------
# The `torch` route: gathered rows and segment reductions in PyTorch
# ----------------------------------------------------------------------------------------------


def _torch_logits(hidden_c, weight, bias, c: KeptChunk):
    w = weight.index_select(0, c.ids).float()  # (Kc, H)
    r = (hidden_c.index_select(0, c.rows).float() * w).sum(-1)
    return r if bias is None else r + bias.index_select(0, c.ids).float()


def _segment_sum(values, c: KeptChunk):
    out = torch.zeros((c.end - c.start, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, c.rows, values)


def _torch_stats(r, c: KeptChunk, logit_map):
    z = logit_map(r)
    m = torch.full((c.end - c.start,), -torch.inf, device=z.device).scatter_reduce(0, c.rows, z, "amax")
    shifted = z - m.index_select(0, c.rows)  # entropy from shifted logits, as row_ops.torch_stats
    e = shifted.exp()
    s = _segment_sum(e, c)
    log_s = s.log()
    return shifted[c.target_entry] - log_s, log_s - _segment_sum(e * shifted, c) / s, m + log_s


def _torch_grad_(r, c: KeptChunk, lse, g, logit_map, g_entropy=None, entropy=None):
    z = logit_map(r)
    if logit_map.softcap is None:
        slope = logit_map.pre
    else:  # dz/dr = pre (post - z) (post + z) / post, as row_ops.torch_grad_
        slope = (logit_map.post - z) * (logit_map.post + z) * (logit_map.pre / logit_map.post)
    logp = z - lse.index_select(0, c.rows)
    p = logp.exp()
    g_e = g.index_select(0, c.rows)
    if g_entropy is None:
        dz = -g_e * p
    else:
        dz = -(g_e + g_entropy.index_select(0, c.rows) * (logp + entropy.index_select(0, c.rows))) * p
    dz[c.target_entry] += g
    return r.copy_(dz * slope)


def _torch_scatter(dr, hidden_c, weight, c: KeptChunk, grads: KeptGrads):
    if grads.grad_hidden is not None:
        w = weight.index_select(0, c.ids).float()
        grads.grad_hidden[c.start:c.end] = _segment_sum(dr.unsqueeze(-1) * w, c)
    if grads.grad_weight is not None:
        grads.grad_weight.index_add_(0, c.ids, dr.unsqueeze(-1) * hidden_c.index_select(0, c.rows).float())
    if grads.grad_bias is not None:
        grads.grad_bias.index_add_(0, c.ids, dr)


def _torch_limits(hdim: int, threads: int) -> tuple[int, int]:
    return max(1, CHUNK_BYTES // (3 * 4 * hdim)), 1 << 62  # a few [Kc, H] float32 temporaries


TORCH_KEPT_OPS = KeptOps(logits=_torch_logits, stats=_torch_stats, grad_=_torch_grad_, scatter=_torch_scatter,
                         chunk_limits=_torch_limits)


# ----------------------------------------------------------------------------------------------
# Routes: a call's positions split between the full vocabulary and the kept sets
# ----------------------------------------------------------------------------------------------


class Routes:
    """The rows of one call split by route: `full` (empty set: the full-vocabulary backend, as without
    kept sets) and `kept` (the rows with a set, and those sets as a KeptSets over them), both int64
    index tensors into the call's rows."""

    def __init__(self, kept: KeptSets):
        lengths = kept.lengths
        self.n = kept.num_positions
        self.full = (lengths == 0).nonzero().squeeze(-1)
        self.kept = (lengths > 0).nonzero().squeeze(-1)
        self.all_kept = self.full.numel() == 0  # (then nothing is copied in or out)
        self.sets = kept if self.all_kept else kept.select(self.kept)

    @staticmethod
    def of(kept: Optional[KeptSets]) -> Optional["Routes"]:
        """None where nothing truncates (no sets, or all empty): the caller's full-vocabulary path, unchanged."""
        return Routes(kept) if kept is not None and kept.truncates else None

    def take(self, t: Optional[Tensor], idx: Tensor) -> Optional[Tensor]:
        """The rows `idx` (self.full or self.kept) of a per-row tensor."""
        if t is None or (self.all_kept and idx is self.kept):
            return t
        return t.index_select(0, idx)

    def merge(self, full: Optional[Tensor], kept: Tensor) -> Tensor:
        """[n, ...] from the full route's rows and the kept route's."""
        if self.all_kept:
            return kept
        out = kept.new_empty((self.n, *kept.shape[1:]))
        if full is not None:
            out[self.full] = full
        out[self.kept] = kept
        return out


def _add_params(a, b):
    """grad_weight / grad_bias of the two routes, summed (None where not wanted)."""
    if a is None or b is None:
        return b if a is None else a
    return a.add_(b)


def routed_forward(impl, hidden, weight, bias, target, routes: Routes, logit_map):
    """(logp, entropy, lse) [n] f32 of `impl`'s full route and its kept route (`impl.kept_forward`)."""
    take, full = routes.take, (None, None, None)
    if routes.full.numel():
        full = impl.forward(take(hidden, routes.full), weight, bias, take(target, routes.full), logit_map)
    kept = impl.kept_forward(take(hidden, routes.kept), weight, bias, take(target, routes.kept), routes.sets, logit_map)
    return tuple(routes.merge(f, k) for f, k in zip(full, kept, strict=True))


def routed_backward(impl, hidden, weight, bias, target, routes: Routes, lse, grad_logp, logit_map, needs,
                    grad_entropy=None, entropy=None):
    """(grad_hidden [n, H], grad_weight, grad_bias) of both routes."""
    take = routes.take

    def args(idx):
        extra = {} if grad_entropy is None else dict(grad_entropy=take(grad_entropy, idx), entropy=take(entropy, idx))
        return (take(hidden, idx), weight, bias, take(target, idx)), (take(lse, idx), take(grad_logp, idx)), extra

    full = (None, None, None)
    if routes.full.numel():
        (h, w, b, t), (lse_f, g_f), extra = args(routes.full)
        full = impl.backward(h, w, b, t, lse_f, g_f, logit_map, needs, **extra)
    (h, w, b, t), (lse_k, g_k), extra = args(routes.kept)
    kept = impl.kept_backward(h, w, b, t, routes.sets, lse_k, g_k, logit_map, needs, **extra)
    grad_hidden = None if kept[0] is None else routes.merge(full[0], kept[0])
    return grad_hidden, _add_params(full[1], kept[1]), _add_params(full[2], kept[2])


def routed_fused(impl, hidden, weight, bias, target, routes: Routes, logit_map, dloss_at: Callable, needs,
                 grad_entropy=None):
    """(logp, entropy, grad_hidden, grad_weight, grad_bias) of both routes in one pass each.
    `dloss_at(rows, logp) -> g`: the loss gradient of the call's rows `rows` (int64) given their log-probs."""
    take = routes.take

    def run(idx, fn, *route_args):
        extra = {} if grad_entropy is None else dict(grad_entropy=take(grad_entropy, idx))
        return fn(take(hidden, idx), weight, bias, take(target, idx), *route_args, logit_map,
                  lambda s, e, lp: dloss_at(idx[s:e], lp), needs, **extra)

    full = run(routes.full, impl.fused) if routes.full.numel() else (None,) * 5
    kept = run(routes.kept, impl.kept_fused, routes.sets)
    logp, entropy = routes.merge(full[0], kept[0]), routes.merge(full[1], kept[1])
    grad_hidden = None if kept[2] is None else routes.merge(full[2], kept[2])
    return logp, entropy, grad_hidden, _add_params(full[3], kept[3]), _add_params(full[4], kept[4])

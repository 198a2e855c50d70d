"""Log-probs over kept sets (truncated sampling, issue 50): the `triton` backend's kept route.

Protocol: `kept_forward`, `kept_backward`, `kept_fused` of grpo_fast/ops/backends.py. Shapes, flattened:
hidden `[N, H]`, weight `[V, H]` (contiguous), bias `[V]` or None, target `[N]` int64, kept: an
`objective.KeptSets` over the N positions, every set non-empty (K ids in all). Position n's logits are
`z_j = LogitMap(h_n . W_j + b_j)` for j in its set only, the log-softmax over the set.

forward   One program per position: it walks its set in tiles of BLOCK_V ids, gathers those weight rows
          (BLOCK_V x BLOCK_K at a time over H), takes the dot products with its hidden row in fp32
          (elementwise products and a sum: each id has its own row, there is no shared operand for
          tl.dot), and folds the tile into an online log-sum-exp (running max m, s = sum exp(z - m),
          t = sum exp(z - m)(z - m), the target's logit). O(k H) a position, no [N, V] anything.
          STORE_Z (fused): it also writes each z into a CSR buffer [K] f32.
dlogits   One program per position: dr_j = [g (onehot - p_j) - g_h p_j (log p_j + H)] dz/dr into a
          CSR buffer [K] f32, from the stored z (fused) or recomputing the gathered dots (backward).
scatter   A program per (position, H block): grad_hidden_n = sum_j dr_j W_j over its set (no other
          program writes that block), and grad_weight[j] += dr_j h_n by fp32 atomic adds into a [V, H]
          buffer (positions that keep the same id meet there). grad_bias is an index_add of dr.

Memory: the z / dr buffers O(K), the fp32 weight-gradient buffer (as the full route's accumulation
across chunks). Not yet timed on a GPU: the launch parameters below are first guesses (a gather is
memory-bound: BLOCK_K = 128 bf16 is a 256-byte row segment a load).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# ids a tile, hidden columns a load; the interpreter's small tiles make tiny test sets span several tiles
BLOCK_V, BLOCK_K, NUM_WARPS = (16, 16, 1) if INTERPRET else (64, 128, 4)


@triton.jit
def _tile_logits(h_row, weight_ptr, bias_ptr, ids, id_ok, H, stride_w, pre, post, HAS_BIAS: tl.constexpr,
                 SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """z [BLOCK_V] f32 of the ids `ids` (int64) for the hidden row at `h_row`: the gathered dot products,
    plus bias, through the logit map (as _logits_tile in linear_logprobs.py)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_ptrs = weight_ptr + ids[:, None] * stride_w + ks[None, :]
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        h = tl.load(h_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=id_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ids, mask=id_ok, other=0.0).to(tl.float32)
    if SOFTCAP:  # tanh(y) = 2 sigmoid(2y) - 1
        return post * (2.0 * tl.sigmoid(2.0 * pre * acc) - 1.0)
    return acc * pre


@triton.jit
def _kept_fwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, ids_ptr, offsets_ptr,  # [N, H], [V, H], [V] | dummy, [N], [K], [N + 1]
    out_ptr,  # [3, N] f32: logp, entropy, lse
    z_ptr,  # [K] f32 out when STORE_Z, else a dummy
    N, H, pre, post, stride_h, stride_w,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, STORE_Z: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0)
    start = tl.load(offsets_ptr + n)
    end = tl.load(offsets_ptr + n + 1)
    target = tl.load(target_ptr + n)
    h_row = hidden_ptr + n.to(tl.int64) * stride_h
    rv = tl.arange(0, BLOCK_V)
    # a finite start (not -inf): (m_old - m_new) * s stays 0, never nan, before the first tile
    m = tl.full([], -1.0e30, dtype=tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    t = tl.zeros([], dtype=tl.float32)
    z_target = tl.zeros([], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_V):
        id_ok = e0 + rv < end
        ids = tl.load(ids_ptr + e0 + rv, mask=id_ok, other=0)
        z = _tile_logits(h_row, weight_ptr, bias_ptr, ids, id_ok, H, stride_w, pre, post, HAS_BIAS, SOFTCAP,
                         BLOCK_V, BLOCK_K)
        if STORE_Z:
            tl.store(z_ptr + e0 + rv, z, mask=id_ok)
        z_target += tl.sum(tl.where(id_ok & (ids == target), z, 0.0), 0)
        z = tl.where(id_ok, z, -1.0e30)  # past the set's end: exp(d) = 0 and p d = 0
        m_new = tl.maximum(m, tl.max(z, 0))
        d = z - m_new
        p = tl.exp(d)
        t = tl.exp(m - m_new) * (t + (m - m_new) * s) + tl.sum(p * d, 0)
        s = tl.exp(m - m_new) * s + tl.sum(p, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(out_ptr + n, z_target - lse)
    tl.store(out_ptr + N + n, log_s - t / s)
    tl.store(out_ptr + 2 * N + n, lse)


@triton.jit
def _kept_dlogits_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, ids_ptr, offsets_ptr,
    lse_ptr, g_ptr, g_h_ptr, h_ent_ptr,  # [N] f32 each; g_h, h_ent dummies unless HAS_ENTROPY_GRAD
    z_ptr,  # [K] f32: the forward's z when STORED, else a dummy (recomputed)
    dr_ptr,  # [K] f32 out
    H, pre, post, stride_h, stride_w,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, STORED: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0)
    start = tl.load(offsets_ptr + n)
    end = tl.load(offsets_ptr + n + 1)
    target = tl.load(target_ptr + n)
    lse = tl.load(lse_ptr + n)
    g = tl.load(g_ptr + n)
    h_row = hidden_ptr + n.to(tl.int64) * stride_h
    rv = tl.arange(0, BLOCK_V)
    for e0 in range(start, end, BLOCK_V):
        id_ok = e0 + rv < end
        ids = tl.load(ids_ptr + e0 + rv, mask=id_ok, other=0)
        if STORED:
            z = tl.load(z_ptr + e0 + rv, mask=id_ok, other=0.0)
        else:
            z = _tile_logits(h_row, weight_ptr, bias_ptr, ids, id_ok, H, stride_w, pre, post, HAS_BIAS, SOFTCAP,
                             BLOCK_V, BLOCK_K)
        logp = z - lse
        p = tl.exp(logp)
        dz = g * ((ids == target).to(tl.float32) - p)  # 1 - p in fp32
        if HAS_ENTROPY_GRAD:
            dz -= tl.load(g_h_ptr + n) * p * (logp + tl.load(h_ent_ptr + n))
        if SOFTCAP:  # dz/dr = pre post (1 - tanh^2), factored as in _dlogits
            dz = dz * (pre * (post - z) * (post + z) / post)
        else:
            dz = dz * pre
        tl.store(dr_ptr + e0 + rv, dz, mask=id_ok)


@triton.jit
def _kept_scatter_kernel(
    hidden_ptr, weight_ptr, ids_ptr, offsets_ptr, dr_ptr,  # [N, H], [V, H], [K], [N + 1], [K] f32
    grad_hidden_ptr,  # [N, H] out (hidden's dtype) when NEED_H, else a dummy
    grad_weight_ptr,  # [V, H] f32, contiguous, added to (atomics) when NEED_W, else a dummy
    H, stride_h, stride_w, stride_gh,
    NEED_H: tl.constexpr, NEED_W: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < H
    start = tl.load(offsets_ptr + n)
    end = tl.load(offsets_ptr + n + 1)
    h = tl.load(hidden_ptr + n.to(tl.int64) * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    rv = tl.arange(0, BLOCK_V)
    for e0 in range(start, end, BLOCK_V):
        id_ok = e0 + rv < end
        ids = tl.load(ids_ptr + e0 + rv, mask=id_ok, other=0)
        d = tl.load(dr_ptr + e0 + rv, mask=id_ok, other=0.0)
        tile_ok = id_ok[:, None] & k_ok[None, :]
        if NEED_H:
            w = tl.load(weight_ptr + ids[:, None] * stride_w + ks[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            acc += tl.sum(d[:, None] * w, axis=0)
        if NEED_W:
            tl.atomic_add(grad_weight_ptr + ids[:, None] * H + ks[None, :], d[:, None] * h[None, :], mask=tile_ok)
    if NEED_H:
        tl.store(grad_hidden_ptr + n.to(tl.int64) * stride_gh + ks, acc.to(grad_hidden_ptr.dtype.element_ty), mask=k_ok)


# ----------------------------------------------------------------------------------------------
# Launchers and the backend protocol
# ----------------------------------------------------------------------------------------------


def _args(hidden, weight, bias, kept):
    assert hidden.stride(-1) == 1 and weight.is_contiguous(), "hidden rows and weight must be contiguous"
    return (bias if bias is not None else weight), kept.ids.contiguous(), kept.offsets.contiguous()


def _forward(hidden, weight, bias, target, kept, logit_map, z=None):
    n, h = hidden.shape
    bias_arg, ids, offsets = _args(hidden, weight, bias, kept)
    out = torch.empty(3, n, dtype=torch.float32, device=hidden.device)
    if n:
        _kept_fwd_kernel[(n,)](hidden, weight, bias_arg, target.contiguous(), ids, offsets, out,
                               z if z is not None else out, n, h, logit_map.pre, logit_map.post, hidden.stride(0),
                               weight.stride(0), HAS_BIAS=bias is not None, SOFTCAP=logit_map.softcap is not None,
                               STORE_Z=z is not None, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out[0], out[1], out[2]


def _gradients(hidden, weight, bias, target, kept, logit_map, lse, g, needs, g_h=None, h_ent=None, z=None):
    """(grad_hidden, grad_weight, grad_bias) from the per-position lse and g (and the entropy's g_h, h_ent),
    with the forward's stored z or recomputing it."""
    n, h = hidden.shape
    bias_arg, ids, offsets = _args(hidden, weight, bias, kept)
    need_h, need_w, need_b = needs
    dr = torch.empty(ids.numel(), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_h else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    if n:
        f32 = lambda t: t.float().contiguous()  # noqa: E731
        g, lse = f32(g), f32(lse)
        _kept_dlogits_kernel[(n,)](hidden, weight, bias_arg, target.contiguous(), ids, offsets, lse, g,
                                   g if g_h is None else f32(g_h), g if h_ent is None else f32(h_ent),
                                   z if z is not None else g, dr, h, logit_map.pre, logit_map.post,
                                   hidden.stride(0), weight.stride(0), HAS_BIAS=bias is not None,
                                   SOFTCAP=logit_map.softcap is not None, STORED=z is not None,
                                   HAS_ENTROPY_GRAD=g_h is not None, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K,
                                   num_warps=NUM_WARPS)
        if need_h or need_w:
            _kept_scatter_kernel[(n, triton.cdiv(h, BLOCK_K))](
                hidden, weight, ids, offsets, dr, grad_hidden if need_h else dr, grad_weight if need_w else dr, h,
                hidden.stride(0), weight.stride(0), grad_hidden.stride(0) if need_h else 0, NEED_H=need_h,
                NEED_W=need_w, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    elif need_h:
        grad_hidden.zero_()
    grad_bias = None
    if need_b and bias is not None:
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device).index_add_(0, ids, dr)
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), grad_bias


def kept_forward(hidden, weight, bias, target, kept, logit_map):
    """(logp, entropy, lse), each [N] f32, over each position's kept set."""
    return _forward(hidden, weight, bias, target, kept, logit_map)


def kept_backward(hidden, weight, bias, target, kept, lse, grad_logp, logit_map, needs=(True, True, True),
                  grad_entropy=None, entropy=None):
    """Gradients of sum(grad_logp * logp [+ grad_entropy * entropy]) w.r.t. (hidden, weight, bias), recomputing
    the gathered logits; None where `needs` says not wanted."""
    if not any(needs):
        return None, None, None
    return _gradients(hidden, weight, bias, target, kept, logit_map, lse, grad_logp, needs, grad_entropy, entropy)


def kept_fused(hidden, weight, bias, target, kept, logit_map, dloss_dlogp: Callable, needs=(True, True, True),
               grad_entropy=None):
    """(logp, entropy, grad_hidden, grad_weight, grad_bias) in one pass: the forward keeps z ([K] f32), the
    callback gets every position's log-probs at once (`dloss_dlogp(0, N, logp)`), the gradients read z back."""
    n = hidden.shape[0]
    z = torch.empty(kept.ids.numel(), dtype=torch.float32, device=hidden.device)
    logp, entropy, lse = _forward(hidden, weight, bias, target, kept, logit_map, z=z)
    g = dloss_dlogp(0, n, logp)
    assert tuple(g.shape) == (n,), f"dloss_dlogp returned shape {tuple(g.shape)}, expected ({n},)"
    grads = _gradients(hidden, weight, bias, target, kept, logit_map, lse, g, needs, grad_entropy,
                       None if grad_entropy is None else entropy, z=z)
    return (logp, entropy, *grads)

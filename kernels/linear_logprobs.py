"""Fused linear -> log-prob / entropy of target ids, over vocabulary tiles (Triton).

The `triton` backend of `grpo_fast.ops` (protocol in `grpo_fast/ops/backends.py`). Shapes, all
flattened: hidden `[N, H]`, weight `[V, H]` (contiguous), bias `[V]` or None, target `[N]` int64;
logits are `z = (hidden @ weight.T + bias) / temperature`, or the model's logit map of the matmul
(`grpo_fast.objective.LogitMap`: `pre * r`, or `post * tanh(pre * r)` with soft-capping, SOFTCAP).

forward  One kernel. Each program owns BLOCK_N rows and a contiguous range of vocabulary tiles
         (a "split"); per tile it computes `z` with `tl.dot` over H blocks and folds it into an
         online log-sum-exp: running max m, s = sum exp(z - m), t = sum exp(z - m) (z - m), and the
         target's logit. Nothing of `z` reaches global memory; the few per-(split, row) partials
         are merged in PyTorch (O(N * splits)). Splits exist to fill the GPU when N is small.
         entropy = log s - t / s (the shifted t avoids the cancellation of lse - sum p z).
backward Per chunk of C rows: one kernel recomputes each [BLOCK_N, BLOCK_V] tile of `z` and writes
         `g * (onehot - softmax(z)) / temperature` (computed in fp32, stored in the input dtype;
         with the entropy bonus also `- g_h p (log p + H) / temperature`, HAS_ENTROPY_GRAD)
         into a bounded [C, V] slab; cuBLAS then does grad_hidden = slab @ W and
         grad_weight += slab.T @ hidden (fp32 accumulation across chunks). 3 matmuls. The chunks
         and the gradient matmuls are the chunk driver's, shared with the CPU backends
         (grpo_fast/ops/chunk_driver.py); this file gives it the workspace budget and the slabs.
fused    Forward and gradients with 3 matmuls, not 4: per chunk the forward kernel also stores
         each logit tile relative to the row's running max, d = z - m (<= 0), in the input dtype,
         plus that max per (row, tile) in fp32 (STORE_LOGITS); the callback turns the chunk's
         log-probs into g; an elementwise kernel turns the slab into the gradient in place
         (p = exp(d + m - lse)); cuBLAS does the two gradient matmuls. The slab costs ~6 bytes of
         memory traffic per logit (bf16), far cheaper than recomputing it (2 H flops).
         Precision: d in bf16 has absolute error |d| 2^-9 <= -log(p) 2^-9, so p has relative error
         <= -log(p) 2^-9 and absolute error <= 2^-9 / e: the same order as storing the gradient
         in bf16, which cuBLAS needs anyway, and far below bf16 logits' |z| 2^-9 (plain PyTorch).
         The plain forward never writes logits; only this gradient path uses the workspace.

Measured on an H200, bf16, N=16384, V=151936 (benchmarks/results/gpu/check_gpu.md): the fused path
takes 1.19x the time of the three cuBLAS matmuls at H=3584 and 1.38x at H=896. The rest is the
storing forward (37 ms against cuBLAS's 26 ms for the logits at H=3584, 12.4 against 6.9 at H=896:
the softmax between tiles does not overlap the wgmma; Triton 3.6 warp-specialises loops on
Blackwell only) and the slab's in-place pass (3.2 ms, memory-bound).

Offsets: each block's start is computed once in int64 (N * H and C * V pass 2**31 at real sizes),
offsets inside a block in int32. The grids are one-dimensional, so N is not bounded by the 65535
limit of grid axes 1 and 2.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from grpo_fast.ops import chunk_driver

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter (3.9) runs tl.dot on bf16 as np.matmul of the uint16 bit patterns it stores
# them as: garbage. There, operands are upcast to fp32 first: bf16 x bf16 products are exact in fp32,
# so this is the same arithmetic as the GPU's bf16 MMA with fp32 accumulation. Never on a GPU.
UPCAST_DOT = INTERPRET


# ----------------------------------------------------------------------------------------------
# Launch parameters: all of them, in one place
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # rows (tokens) per program
    block_v: int  # vocabulary columns per tile
    block_k: int  # hidden-dim slice per tl.dot step
    num_warps: int
    num_stages: int  # software-pipelining depth of the H loop
    maxnreg: Optional[int] = None  # register cap a thread (None: the compiler's choice, up to 255)
    tma_store: bool = False  # fused role: store the logit tiles through a TMA descriptor (Hopper)

    def launch_options(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        return opts if self.maxnreg is None else {**opts, "maxnreg": self.maxnreg}


@dataclass(frozen=True)
class KernelConfigs:
    """One launch configuration per kernel role: they are timed and chosen separately."""

    forward: LaunchConfig  # log-probs only: the old-policy and reference passes, a separate forward
    fused: LaunchConfig  # forward that keeps its logit tiles + the in-place gradient kernel (training)
    backward: LaunchConfig  # the backward that recomputes the logit tiles


# Hopper (H100/H200), bf16/fp16, timed on an H200 at N=16384, V=151936, H=896 and 3584
# (benchmarks/check_gpu.py --sweep; benchmarks/results/gpu/check_gpu.md):
# - forward, backward: 128x256 tiles over 8 warps (two warpgroups of wgmma), 3 stages of 128x64 +
#   256x64 bf16 operands = 144 KiB of shared memory. Against 128x128: forward 33.1 -> 29.9 ms at
#   H=3584 (538 -> 597 TFLOP/s) and 10.0 -> 8.4 ms at H=896; the backward kernel 8.0 -> 7.2 ms.
# - fused (the forward that also stores its logit tiles): 128x128, the tiles stored through a TMA
#   descriptor (as fast as plain stores at this tile: 37.3 vs 37.2 ms at H=3584). With plain stores
#   a 128x256 tile's addresses spill registers (ptxas: 472 bytes); through TMA it does not, and its
#   storing forward is the fastest measured (32.8 ms at H=3584, 9.9 at H=896, against 37.3 / 12.5),
#   but its gradient kernel then ran 128x256 blocks (6.0 ms against 3.2) and the fused path was no
#   faster in all. That kernel now takes at most TO_GRAD_ELEMENTS a program (64x256 there), which
#   should make 128x256 the better fused tile (projected 25.9 ms at H=896, 1.24x the floor): not yet
#   timed, so not the default. Sweep it first (benchmarks/check_gpu.py --sweep).
# ptxas gives every one of them 255 registers a thread (one program per SM); capping them at 128 to
# fit two programs per SM spilled and ran slower (39.7 vs 33.1 ms). Compiled for sm_90 in the CPU
# suite (tests/kernels/test_compile_sm90.py): wgmma, pipelined H loop, shared memory in bounds.
# fp32 inputs use exact fp32 products (input_precision="ieee", no tf32, like torch's default), which
# run on FMA units: smaller tiles keep registers and shared memory in bounds. Not the fast path.
_WIDE = LaunchConfig(block_n=128, block_v=256, block_k=64, num_warps=8, num_stages=3)
_SQUARE = LaunchConfig(block_n=128, block_v=128, block_k=64, num_warps=8, num_stages=3, tma_store=True)
_FP32 = LaunchConfig(block_n=64, block_v=64, block_k=32, num_warps=4, num_stages=2)
GPU_CONFIGS = {
    torch.bfloat16: KernelConfigs(forward=_WIDE, fused=_SQUARE, backward=_WIDE),
    torch.float16: KernelConfigs(forward=_WIDE, fused=_SQUARE, backward=_WIDE),
    torch.float32: KernelConfigs(forward=_FP32, fused=_FP32, backward=_FP32),
}
# The in-place gradient kernel streams the slab (memory-bound): 4 warps a 128x128 tile ran at
# 3.2 ms for 16384 x 151936 bf16 (10 GB moved, ~3.1 TB/s), 8 warps at 5.9 ms (the sweep before
# this constant existed, when the kernel took the tile configuration's num_warps), 4 warps on
# 128x256 at 6.0 ms. Its columns must be the fused forward's tiles (one running max each); its
# rows are free: at most TO_GRAD_ELEMENTS a program.
TO_GRAD_WARPS = 4
TO_GRAD_ELEMENTS = 128 * 128
# The interpreter uses the smallest tiles tl.dot accepts on a GPU (16), so tiny test shapes still
# span several tiles, tails and chunks; it runs the TMA store too.
INTERPRET_CONFIG = LaunchConfig(block_n=16, block_v=16, block_k=16, num_warps=1, num_stages=1, tma_store=True)
# Forward splits: aim for this many programs per multiprocessor, so the last wave is a small part
# of the work (each program is long: BLOCK_N rows x its share of V).
PROGRAMS_PER_SM = 8
# Backward: programs are ordered in groups of GROUP_N row blocks (the column sweep of a group
# reuses its hidden rows from L2), as in Triton's matmul tutorial.
GROUP_N = 8
# Gradient workspace of one chunk: the [C, V] slab in the input dtype (plus C x V/BLOCK_V fp32 tile
# maxima in the fused path). At most 1/16 of the GPU's memory and 8 GiB: on an H200 16384 rows at
# V=151936 in bf16 (5 GB) are one chunk, so grad_weight is one cuBLAS product with no fp32 sum
# across chunks (that sum and its casts cost ~5 ms of 110 at H=3584 with two chunks); a 24 GB GPU
# gets 1.5 GiB. Larger N: more chunks, the same bound (the loss's memory stays O(N)).
WORKSPACE_BYTES = 8 << 30
WORKSPACE_FRACTION = 16


def to_grad_rows(cfg: LaunchConfig) -> int:
    """Row block of the in-place gradient kernel over the fused role's `cfg` tiles."""
    return max(1, min(cfg.block_n, TO_GRAD_ELEMENTS // cfg.block_v))


def launch_config(dtype: torch.dtype, role: str) -> LaunchConfig:
    """The launch configuration of kernel `role` ("forward", "fused", "backward") for `dtype`."""
    return INTERPRET_CONFIG if INTERPRET else getattr(GPU_CONFIGS[dtype], role)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a pretend GPU, so that tiny tests still use several splits


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _logits_tile(h_base, w_base, b_base, row_ok, col_ok, H, stride_h, stride_w, pre, post,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """z [BLOCK_N, BLOCK_V] f32 = the logit map of r = hidden rows @ weight rows.T + bias: r * pre (pre = 1 / T
    for a bare temperature), or post * tanh(pre * r) with SOFTCAP.

    h_base, w_base, b_base point at the block's first row / column (int64 math done by the caller,
    once, on scalars); offsets inside the block are int32, which halves the registers that the
    address tensors of the pipelined loads take (measured with ptxas: 226 -> 128 a thread)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_base + (tl.arange(0, BLOCK_N)[:, None] * stride_h + ks[None, :])  # (BLOCK_N, BLOCK_K)
    w_ptrs = w_base + (tl.arange(0, BLOCK_V)[:, None] * stride_w + ks[None, :])  # (BLOCK_V, BLOCK_K)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + ks) < H
            h = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies the raw bits of bf16 (see UPCAST_DOT)
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:  # fp32 inputs: exact products, as torch's fp32 matmul (no tf32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:  # bf16/fp16 operands, fp32 accumulation
            acc = tl.dot(h, tl.trans(w), acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_base + tl.arange(0, BLOCK_V), mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:  # tanh(y) = 2 sigmoid(2y) - 1 (saturates to +-1, never nan)
        return post * (2.0 * tl.sigmoid(2.0 * pre * acc) - 1.0)
    return acc * pre


@triton.jit
def _dlogits(z, is_target, lse, g, g_h, h, pre, post, SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr):
    """d(sum_rows g * logp[target] [+ g_h * H]) / dr (r: the matmul's logits) = g (onehot - p) dz/dr
    [- g_h p (log p + H) dz/dr: the entropy's gradient], p = softmax(z), in fp32 (1 - p is never
    formed in bf16, where it cancels for confident tokens). dz/dr = pre (1 / T), or with SOFTCAP
    pre * (post - z) (post + z) / post = pre * post * (1 - tanh^2), from z itself."""
    logp = z - lse[:, None]
    p = tl.exp(logp)
    if SOFTCAP:
        dz = g[:, None] * (is_target.to(tl.float32) - p)
        if HAS_ENTROPY_GRAD:
            dz -= g_h[:, None] * p * (logp + h[:, None])
        return dz * (pre * (post - z) * (post + z) / post)  # (factored: no cancellation of post - z^2 / post)
    dz = (g * pre)[:, None] * (is_target.to(tl.float32) - p)
    if HAS_ENTROPY_GRAD:
        dz -= (g_h * pre)[:, None] * p * (logp + h[:, None])
    return dz


@triton.jit
def _linear_logprobs_fwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr,  # [N, H], [V, H], [V] | dummy, [N] int64
    stats_ptr,  # [S, 4, N] f32 out: per split m, s, t, target logit
    logits_ptr,  # [N, V] out when STORE_LOGITS (fused path): z - running max, input dtype; else a dummy
    logits_desc,  # the same [N, V] as a TMA descriptor when TMA_STORE, else None
    tile_max_ptr,  # [N, n_tiles] f32 out when STORE_LOGITS: that running max per row and tile
    N, V, H, pre, post, n_splits, tiles_per_split,
    stride_h, stride_w, stride_l, stride_m,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, STORE_LOGITS: tl.constexpr, TMA_STORE: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # 1-D grid, split fastest: programs running together share hidden rows (L2) and sweep W.
    pid = tl.program_id(0)
    split = pid % n_splits
    row0 = (pid // n_splits) * BLOCK_N
    rn = tl.arange(0, BLOCK_N)
    rv = tl.arange(0, BLOCK_V)
    row_ok = row0 + rn < N
    h_base = hidden_ptr + row0.to(tl.int64) * stride_h  # int64: N * H passes 2**31 at real sizes
    target = tl.load(target_ptr + row0 + rn, mask=row_ok, other=-1).to(tl.int32)  # V < 2**31

    # Finite start (not -inf): (m_old - m_new) * s stays 0, never nan, before the first tile.
    m = tl.full([BLOCK_N], -1.0e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    z_target = tl.zeros([BLOCK_N], dtype=tl.float32)
    tile_lo = split * tiles_per_split
    n_tiles = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(V, BLOCK_V)) - tile_lo
    for i in range(0, n_tiles):
        col0 = (tile_lo + i) * BLOCK_V
        col_ok = col0 + rv < V
        z = _logits_tile(h_base, weight_ptr + col0.to(tl.int64) * stride_w, bias_ptr + col0, row_ok, col_ok,
                         H, stride_h, stride_w, pre, post, HAS_BIAS, SOFTCAP, EVEN_K, IEEE, UPCAST,
                         BLOCK_N, BLOCK_V, BLOCK_K)
        z_target += tl.sum(tl.where(rv[None, :] == (target - col0)[:, None], z, 0.0), 1)  # z dies early
        # padded columns: a finite floor, so that exp(d) = 0 and p * d = 0 (never 0 * -inf) without a mask
        z = tl.where(col_ok[None, :], z, -1.0e30)
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        d = z - m_new[:, None]
        if STORE_LOGITS:
            if TMA_STORE:  # the copy engine writes the tile (tails clipped): no address registers
                logits_desc.store([row0, col0], d.to(logits_desc.dtype))
            else:
                l_base = logits_ptr + row0.to(tl.int64) * stride_l + col0
                tl.store(l_base + (rn[:, None] * stride_l + rv[None, :]), d.to(logits_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & col_ok[None, :])
            tl.store(tile_max_ptr + row0.to(tl.int64) * stride_m + (tile_lo + i) + rn * stride_m, m_new, mask=row_ok)
        p = tl.exp(d)  # 0 on padded columns
        t = alpha * (t + (m - m_new) * s) + tl.sum(p * d, 1)
        s = alpha * s + tl.sum(p, 1)
        m = m_new

    out = stats_ptr + (split.to(tl.int64) * 4) * N + row0 + rn  # int64: S * 4 * N may pass 2**31
    tl.store(out, m, mask=row_ok)
    tl.store(out + N, s, mask=row_ok)
    tl.store(out + 2 * N, t, mask=row_ok)
    tl.store(out + 3 * N, z_target, mask=row_ok)


@triton.jit
def _grouped_tile(pid, n_row_blocks, n_col_tiles, GROUP: tl.constexpr):
    """Program id -> (row block, column tile), GROUP row blocks at a time, row block fastest."""
    per_group = GROUP * n_col_tiles
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_row_blocks - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _row_inputs(target_ptr, lse_ptr, g_ptr, g_h_ptr, h_ptr, row0, rn, row_ok, HAS_ENTROPY_GRAD: tl.constexpr):
    """target (int32), lse, g of the block's rows; with the entropy's gradient also g_h and the
    entropy H (else g again, unused)."""
    target = tl.load(target_ptr + row0 + rn, mask=row_ok, other=-1).to(tl.int32)
    lse = tl.load(lse_ptr + row0 + rn, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + row0 + rn, mask=row_ok, other=0.0)
    g_h, h = g, g
    if HAS_ENTROPY_GRAD:
        g_h = tl.load(g_h_ptr + row0 + rn, mask=row_ok, other=0.0)
        h = tl.load(h_ptr + row0 + rn, mask=row_ok, other=0.0)
    return target, lse, g, g_h, h


@triton.jit
def _linear_logprobs_bwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, lse_ptr, g_ptr,  # [C, H], [V, H], [V], [C], [C], [C]
    g_h_ptr, h_ptr,  # [C], [C] f32 when HAS_ENTROPY_GRAD: d(loss)/d(entropy), the entropy; else dummies
    grad_ptr,  # [C, V] out, input dtype: g (onehot - p) / T [- g_h p (log p + H) / T]
    N, V, H, pre, post,
    stride_h, stride_w, stride_g,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, GROUP: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rb, ct = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP)
    row0, col0 = rb * BLOCK_N, ct * BLOCK_V
    rn, rv = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_V)
    row_ok, col_ok = row0 + rn < N, col0 + rv < V
    target, lse, g, g_h, h = _row_inputs(target_ptr, lse_ptr, g_ptr, g_h_ptr, h_ptr, row0, rn, row_ok,
                                         HAS_ENTROPY_GRAD)
    z = _logits_tile(hidden_ptr + row0.to(tl.int64) * stride_h, weight_ptr + col0.to(tl.int64) * stride_w,
                     bias_ptr + col0, row_ok, col_ok, H, stride_h, stride_w, pre, post,
                     HAS_BIAS, SOFTCAP, EVEN_K, IEEE, UPCAST, BLOCK_N, BLOCK_V, BLOCK_K)
    dz = _dlogits(z, rv[None, :] == (target - col0)[:, None], lse, g, g_h, h, pre, post, SOFTCAP, HAS_ENTROPY_GRAD)
    g_base = grad_ptr + row0.to(tl.int64) * stride_g + col0  # int64: C * V may pass 2**31
    tl.store(g_base + (rn[:, None] * stride_g + rv[None, :]), dz.to(grad_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _logits_to_grad_kernel(
    logits_ptr,  # [C, V] in/out, input dtype: d = z - tile max (forward's STORE_LOGITS) -> gradient
    tile_max_ptr, target_ptr, lse_ptr, g_ptr,  # [C, n_tiles] f32, [C], [C], [C]
    g_h_ptr, h_ptr,  # [C], [C] f32 when HAS_ENTROPY_GRAD, else dummies
    z_target_ptr,  # [C] f32 when SOFTCAP: the target's logit from the forward's fp32 sums, else a dummy
    N, V, pre, post, stride_l, stride_m,
    SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(V, BLOCK_V)
    row0, col0 = (pid // n_col_tiles) * BLOCK_N, (pid % n_col_tiles) * BLOCK_V
    rn, rv = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_V)
    row_ok, col_ok = row0 + rn < N, col0 + rv < V
    mask = row_ok[:, None] & col_ok[None, :]
    target, lse, g, g_h, h = _row_inputs(target_ptr, lse_ptr, g_ptr, g_h_ptr, h_ptr, row0, rn, row_ok,
                                         HAS_ENTROPY_GRAD)
    tile_max = tl.load(tile_max_ptr + row0.to(tl.int64) * stride_m + (pid % n_col_tiles) + rn * stride_m,
                       mask=row_ok, other=0.0)
    ptrs = logits_ptr + row0.to(tl.int64) * stride_l + col0 + (rn[:, None] * stride_l + rv[None, :])
    d = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z = d + tile_max[:, None]
    is_target = rv[None, :] == (target - col0)[:, None]
    if SOFTCAP:  # the target's slope post + z cancels at -post, where the slab's d has an error of |d| 2^-9: the
        # forward's own fp32 target logit instead (elsewhere p is small where the slope is imprecise)
        z_target = tl.load(z_target_ptr + row0 + rn, mask=row_ok, other=0.0)
        z = tl.where(is_target, z_target[:, None], z)
    dz = _dlogits(z, is_target, lse, g, g_h, h, pre, post, SOFTCAP, HAS_ENTROPY_GRAD)
    tl.store(ptrs, dz.to(logits_ptr.dtype.element_ty), mask=mask)  # in place: each element read, then written


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def fwd_grid(n: int, vocab: int, cfg: LaunchConfig, num_sms: int):
    """((programs,), splits, tiles_per_split) of the forward kernel: a 1-D grid whatever N is."""
    row_blocks = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(vocab, cfg.block_v)
    splits = max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * num_sms, row_blocks)))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no empty split
    return (row_blocks * splits,), splits, tiles_per_split


def tile_grid(n: int, vocab: int, cfg: LaunchConfig):
    """(programs,) of the per-tile kernels (backward, logits -> gradient): 1-D, whatever N is."""
    return (triton.cdiv(n, cfg.block_n) * triton.cdiv(vocab, cfg.block_v),)


def _common(hidden, weight, bias, logit_map, role):
    assert hidden.stride(-1) == 1 and weight.is_contiguous(), "hidden rows and weight must be contiguous"
    cfg = launch_config(hidden.dtype, role)
    consts = dict(HAS_BIAS=bias is not None, SOFTCAP=logit_map.softcap is not None, EVEN_K=hidden.shape[1] % cfg.block_k == 0,
                  IEEE=hidden.dtype == torch.float32, UPCAST=UPCAST_DOT and hidden.dtype != torch.float32,
                  BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, **cfg.launch_options())
    return cfg, consts, (bias if bias is not None else weight)  # dummy pointer when no bias


def _launch_fwd(hidden, weight, bias, target, logit_map, logits=None, tile_max=None):
    """Per-split partials [S, 4, N] f32 (m, s, t, target logit). With `logits` [N, V] (input dtype)
    and `tile_max` [N, n_tiles] f32, also stores z - running max and the running max per tile."""
    (n, h), vocab = hidden.shape, weight.shape[0]
    cfg, consts, bias_arg = _common(hidden, weight, bias, logit_map, "forward" if logits is None else "fused")
    grid, splits, tiles_per_split = fwd_grid(n, vocab, cfg, _num_sms(hidden.device))
    stats = torch.empty(splits, 4, n, dtype=torch.float32, device=hidden.device)
    desc = None
    if logits is not None and cfg.tma_store and _tma_ok(logits):
        desc = TensorDescriptor(logits, list(logits.shape), list(logits.stride()), [cfg.block_n, cfg.block_v])
    _linear_logprobs_fwd_kernel[grid](
        hidden, weight, bias_arg, target, stats,
        logits if logits is not None else stats, desc, tile_max if tile_max is not None else stats,
        n, vocab, h, logit_map.pre, logit_map.post, splits, tiles_per_split, hidden.stride(0), weight.stride(0),
        logits.stride(0) if logits is not None else 0, tile_max.stride(0) if tile_max is not None else 0,
        STORE_LOGITS=logits is not None, TMA_STORE=desc is not None, **consts,
    )
    return stats


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs 16-byte aligned base and row stride, unit inner stride."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _slab(rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[rows, vocab] workspace whose row stride is a multiple of 16 elements (TMA-aligned)."""
    return torch.empty(rows, triton.cdiv(vocab, 16) * 16, dtype=dtype, device=device)[:, :vocab]


def _merge_splits(stats):
    """[S, 4, N] partials -> (logp, entropy, lse), each [N] f32: the log-sum-exp merge."""
    m, s, t, z_target = stats.unbind(1)  # each [S, N]
    m_all = m.amax(0)
    scale = torch.exp(m - m_all)
    s_all = (s * scale).sum(0)
    t_all = ((t + (m - m_all) * s) * scale).sum(0)  # sum exp(z - m_all) (z - m_all)
    log_s = torch.log(s_all)
    lse = m_all + log_s
    return z_target.sum(0) - lse, log_s - t_all / s_all, lse


def _launch_bwd(hidden, weight, bias, target, lse, g, logit_map, grad_logits, g_h=None, h=None):
    """grad_logits [C, V] <- g (onehot - softmax) dz/dr [- g_h p (log p + H) dz/dr with g_h, h [C] f32],
    recomputing the logits tile by tile."""
    (n, hdim), vocab = hidden.shape, weight.shape[0]
    cfg, consts, bias_arg = _common(hidden, weight, bias, logit_map, "backward")
    _linear_logprobs_bwd_kernel[tile_grid(n, vocab, cfg)](
        hidden, weight, bias_arg, target, lse, g, g if g_h is None else g_h, g if h is None else h, grad_logits,
        n, vocab, hdim, logit_map.pre, logit_map.post, hidden.stride(0), weight.stride(0), grad_logits.stride(0), GROUP=GROUP_N,
        HAS_ENTROPY_GRAD=g_h is not None, **consts,
    )


def _launch_logits_to_grad(logits, tile_max, target, lse, g, logit_map, g_h=None, h=None, z_target=None):
    """In place: logits [C, V] (z - tile max, from the forward) <- g (onehot - softmax) dz/dr
    [- g_h p (log p + H) dz/dr with g_h, h [C] f32]; z_target [C] f32: the target's logit (soft-capping)."""
    n, vocab = logits.shape
    cfg = launch_config(logits.dtype, "fused")  # the tiles of the forward that wrote the slab
    assert tile_max.shape == (n, triton.cdiv(vocab, cfg.block_v))
    rows = to_grad_rows(cfg)
    _logits_to_grad_kernel[(triton.cdiv(n, rows) * triton.cdiv(vocab, cfg.block_v),)](
        logits, tile_max, target, lse, g, g if g_h is None else g_h, g if h is None else h,
        g if z_target is None else z_target, n, vocab,
        logit_map.pre, logit_map.post, logits.stride(0), tile_max.stride(0), SOFTCAP=logit_map.softcap is not None,
        HAS_ENTROPY_GRAD=g_h is not None,
        BLOCK_N=rows, BLOCK_V=cfg.block_v, num_warps=TO_GRAD_WARPS,
    )


# ----------------------------------------------------------------------------------------------
# Backend protocol (see grpo_fast/ops/backends.py)
# ----------------------------------------------------------------------------------------------


def forward(hidden, weight, bias, target, logit_map):
    """(logp, entropy, lse), each [N] f32, of target [N] under logit_map(hidden [N, H] @ weight.T + bias).

    One kernel launch; no logits in global memory."""
    n = hidden.shape[0]
    if n == 0:
        return tuple(hidden.new_empty(0, dtype=torch.float32) for _ in range(3))
    return _merge_splits(_launch_fwd(hidden, weight, bias, target.contiguous(), logit_map))


def workspace_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return WORKSPACE_BYTES
    return min(WORKSPACE_BYTES, torch.cuda.get_device_properties(device).total_memory // WORKSPACE_FRACTION)


def _chunks(n: int, vocab: int, bytes_per_logit: int, chunk_size: Optional[int], budget: int = WORKSPACE_BYTES):
    """(rows of the workspace, [(start, end)] chunks): the chunk driver's plan within the workspace
    budget, in chunks of equal size (a small tail runs cuBLAS at a low rate)."""
    return chunk_driver.plan(n, vocab, bytes_per_logit, budget=budget, balanced=True, chunk_size=chunk_size)


def backward(hidden, weight, bias, target, lse, grad_logp, logit_map, needs=(True, True, True), chunk_size=None,
             grad_entropy=None, entropy=None):
    """Gradients (grad_hidden [N, H], grad_weight [V, H], grad_bias [V] | None) of
    sum(grad_logp * logp [+ grad_entropy * entropy]), given the forward's lse [N] (and entropy [N]
    with grad_entropy [N]); None where `needs` says not wanted.

    Per chunk of C rows: one kernel recomputes the logits tiles into the gradient slab [C, V]
    (input dtype), then two cuBLAS matmuls. `chunk_size` overrides the workspace budget (tests)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if not any(needs):
        return None, None, None
    step, spans = _chunks(n, vocab, hidden.element_size(), chunk_size, workspace_bytes(hidden.device))
    slab = torch.empty(step, vocab, dtype=hidden.dtype, device=hidden.device) if n else None
    g, lse, target = grad_logp.float().contiguous(), lse.float().contiguous(), target.contiguous()
    g_h = h = None
    if grad_entropy is not None:
        g_h, h = grad_entropy.float().contiguous(), entropy.float().contiguous()

    def chunk_grad(s, e):
        grad_logits = slab[: e - s]
        _launch_bwd(hidden[s:e], weight, bias, target[s:e], lse[s:e], g[s:e], logit_map, grad_logits,
                    None if g_h is None else g_h[s:e], None if h is None else h[s:e])
        return grad_logits

    return chunk_driver.param_grads(hidden, weight, bias, needs, spans, hidden.dtype, chunk_grad)


def fused(hidden, weight, bias, target, logit_map, dloss_dlogp: Callable, needs=(True, True, True), chunk_size=None,
          grad_entropy=None):
    """(logp [N] f32, entropy [N] f32, grad_hidden, grad_weight, grad_bias) in one pass.

    `dloss_dlogp(start, end, logp_chunk [C]) -> g [C]` gives the loss gradient of the chunk's tokens
    once their log-probs are known; grad_entropy [N] f32 (or None): the loss's gradient w.r.t. each
    token's entropy (the entropy bonus), applied with the entropy the same pass computes. Per chunk: the forward kernel also keeps its logit tiles (relative
    to the running max) in a [C, V] slab, the slab becomes the gradient in place, then two cuBLAS
    matmuls: 3 matmuls in all, against 4 for forward + backward."""
    n, vocab = hidden.shape[0], weight.shape[0]
    step, spans = _chunks(n, vocab, hidden.element_size(), chunk_size, workspace_bytes(hidden.device))
    logp = hidden.new_empty(n, dtype=torch.float32)
    entropy = torch.empty_like(logp)
    target = target.contiguous()
    slab = tile_max = None
    if n:
        slab = _slab(step, vocab, hidden.dtype, hidden.device)
        tile_max = torch.empty(step, triton.cdiv(vocab, launch_config(hidden.dtype, "fused").block_v),
                               dtype=torch.float32, device=hidden.device)

    def chunk_grad(s, e):
        logits = slab[: e - s]
        stats = _launch_fwd(hidden[s:e], weight, bias, target[s:e], logit_map, logits, tile_max[: e - s])
        logp[s:e], entropy[s:e], lse = _merge_splits(stats)
        g = dloss_dlogp(s, e, logp[s:e])
        assert tuple(g.shape) == (e - s,), f"dloss_dlogp returned shape {tuple(g.shape)}, expected ({e - s},)"
        g_h = None if grad_entropy is None else grad_entropy[s:e].float().contiguous()
        _launch_logits_to_grad(logits, tile_max[: e - s], target[s:e], lse, g.float().contiguous(), logit_map,
                               g_h, None if g_h is None else entropy[s:e].contiguous(),
                               z_target=None if logit_map.softcap is None else logp[s:e] + lse)
        return logits

    return (logp, entropy, *chunk_driver.param_grads(hidden, weight, bias, needs, spans, hidden.dtype, chunk_grad))

"""Attention for packed rows without flash-attention: each sequence attends only within itself.

A packed micro-batch is one row of L tokens holding many sequences. With a dense block-diagonal
mask, SDPA still computes every (query, key) pair of the row, L^2 of them, and throws most away:
at L = 1024 on the CPU that was 28% of a SmolLM2 training forward+backward in float32 (torch
profiler, `aten::_scaled_dot_product_flash_attention_for_cpu` forward and backward). Here q, k, v
are gathered into one padded row per sequence, `[n, heads, longest, head_dim]`, SDPA runs causally
on that, and the real positions are scattered back: the cost is n * longest^2, not L^2. Padding
sits at the end of each row, so no real query ever sees it.

Used through transformers' attention interface: `packed_attention(model)` switches the model's
attention implementation to this function for one forward (it reads `cu_seq_lens_q`, which the
packed micro-batch passes through the model's keyword arguments) and builds no mask.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..compat import attention_implementation, set_attention_implementation

NAME = "grpo_fast_packed_sdpa"


def supports_packed_attention(model) -> bool:
    """True when this module can attend for `model`'s packed rows, as the model itself would.

    Needs: attention called through transformers' interface (so it can be swapped); no gradient
    checkpointing (its backward recompute runs after the swap is undone, i.e. without it); no
    attention sinks or logit soft-capping (not implemented here; `packed_sdpa_forward` also refuses
    them at run time, so nothing is computed differently in silence).
    """
    config = getattr(model, "config", None)
    return (bool(getattr(model, "_supports_attention_backend", False))
            and not getattr(model, "is_gradient_checkpointing", False)
            and getattr(config, "attn_logit_softcapping", None) is None
            and not any(hasattr(m, "sinks") for m in model.modules()))


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs):
    """query [1, Hq, L, d], key / value [1, Hkv, L, d] -> ([1, L, Hq, d], None).

    kwargs["cu_seq_lens_q"]: [n + 1] int, where each packed sequence starts (and L at the end).
    """
    starts = kwargs["cu_seq_lens_q"]
    lengths = starts[1:] - starts[:-1]
    longest = int(lengths.max())
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    window = kwargs.get("sliding_window")
    if window is not None and longest > window:
        unsupported.append(f"sliding_window={window} shorter than a packed sequence ({longest} tokens)")
    if unsupported or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"packed attention: {type(module).__name__} needs {unsupported or 'non-causal attention'}, "
                                  "which grpo_fast's per-sequence SDPA does not implement")
    sizes = lengths.tolist()

    def rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, L, d] -> [n, H, longest, d], zero-padded
        # split + pad, not an index gather: the gather's backward is an accumulating index_put, which
        # ran at 1 s of a 25 s default-run train part on the CPU; pad_sequence's backward is slices.
        return pad_sequence(x[0].transpose(0, 1).split(sizes), batch_first=True).transpose(1, 2)

    q, k, v = rows(query), rows(key), rows(value)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves several q heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    with _sdpa_backend(q):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
    out = out.transpose(1, 2)  # [n, longest, H, d]
    return torch.cat([o[:size] for o, size in zip(out.unbind(0), sizes, strict=True)])[None], None  # [1, L, H, d]


def _sdpa_backend(q: torch.Tensor):
    """bf16 / fp16 on the CPU: SDPA's math backend. Its flash kernel's backward is slow there on
    these short rows ([16, 9, 100, 64] bf16: 25 ms against 6.4 ms for math; float32: 9.4 vs 11 ms,
    so float32 keeps the default choice). Under autocast SDPA computes in the autocast dtype
    whatever q's (the rotary embedding hands it float32 q and k): 33.5 ms flash, 14.4 ms math
    ([12, 9, 90, 64] forward + backward on an AMX Xeon; it was 22% of the default run's train part)."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def _no_mask(*args, **kwargs):
    return None  # each sequence is its own causal row: nothing to mask


@contextlib.contextmanager
def packed_attention(model):
    """Within the block, `model` attends with `packed_sdpa_forward` (inputs must carry cu_seq_lens_q)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    previous = attention_implementation(model.config)
    set_attention_implementation(model.config, NAME)
    try:
        yield
    finally:
        set_attention_implementation(model.config, previous)

"""Every use of a torch or transformers internal, in one place (vLLM's are in generation/engines/vllm_compat.py).

Each shim names what it reaches into and the version or change that would let it go; a dependency upgrade that
breaks one breaks it here, and `tests/test_compat.py` checks each still reaches what it needs. Light at import
(torch and transformers are imported inside the shims).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def autograd_inside_custom_op():
    """Let tensors record an autograd graph inside a custom op's kernel.

    The dispatcher runs a kernel with the autograd keys excluded (the op's autograd is the registered one), so
    `torch.autograd.grad` there would see no graph; this lets those keys back in for the block. Reaches
    `torch._C._ForceDispatchKeyGuard` and the thread-local dispatch key sets (torch 2.13): goes when torch has a
    public way to differentiate inside a kernel (torch.func.grad records there, but its wrapper tensors break
    dispatch modes active around the op, such as opcheck's schema check)."""
    import torch
    from torch._C import DispatchKey

    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def disable_dynamo(fn):
    """`fn` that torch.compile does not trace, as `torch.library.custom_op` wraps a kernel (`torch._disable_dynamo`,
    torch 2.13): goes when torch.library's lower-level API takes custom_op's wrapper itself."""
    import torch

    return torch._disable_dynamo(fn)


def settle_fsdp_root(root) -> None:
    """Make the FSDP2 module `root` the root of its tree now (FSDP2 takes the first unit whose forward runs as the
    root; `_get_fsdp_state()._lazy_init()`, torch 2.13): goes when fully_shard lets one name the root."""
    root._get_fsdp_state()._lazy_init()


def cpu_has_bf16_matmul() -> bool:
    """bf16 matmul hardware on this CPU (avx512_bf16 or AMX). Without it torch emulates bf16: 1.3 against 175
    GFLOP/s in float32 on an AVX2-only EPYC (benchmarks/results/profile_train_cpu.md). `torch.cpu._is_*`
    (torch 2.13): goes when torch.cpu exposes its feature queries publicly."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def attention_implementation(model_config) -> str:
    """The attention a transformers model runs ("sdpa", "flash_attention_2", a registered name). transformers 5.19
    keeps it in the private `config._attn_implementation`: goes when the config exposes it publicly."""
    return getattr(model_config, "_attn_implementation", None) or ""


def set_attention_implementation(model_config, name: str) -> None:
    """Switch the attention of the model behind `model_config` to a registered `name` for the forwards that follow,
    without the checks of `model.set_attn_implementation` (which refuses names it does not ship; transformers
    5.19): goes when registered attention functions can be selected publicly per call."""
    model_config._attn_implementation = name

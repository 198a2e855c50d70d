"""Registering the fused ops with PyTorch's dispatcher, without loading the compiler when eager.

`torch.library.custom_op` wraps each kernel in `torch._disable_dynamo`, which imports
`torch._dynamo` at the kernel's first call, eager or not, and with it sympy and (where installed)
triton: ~900 modules, ~180 MB more RSS and seconds of start-up in a process that only wanted one
CPU loss (measured: 1148 -> 2045 modules, 228 -> 407 MB, torch 2.13). The registrations below are
custom_op's, made with torch.library's lower-level API (`define`, `impl`, `register_fake`,
`register_autograd`), so `torch.compile` and `opcheck` see the same op: schema, pt2-compliant tag,
fake and autograd implementations. Only the kernel's wrapper differs: it disables dynamo once
`torch._dynamo` is loaded, and runs the kernel as it is before, when no frame can be traced.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

from ..compat import disable_dynamo

NAMESPACE = "grpo_fast"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive here: the ops live as long as the module


def _dynamo_disabled_once_loaded(kernel: Callable) -> Callable:
    """`kernel` behind `torch._disable_dynamo` (as custom_op registers it) once torch._dynamo is
    imported; before that nothing can trace it (dynamo's frame hook is installed only through
    torch._dynamo), so it runs as it is and the import is not paid."""
    disabled = None

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return kernel(*args, **kwargs)
            disabled = disable_dynamo(kernel)
        return disabled(*args, **kwargs)

    return run


def define(name: str, schema: str, kernel: Callable, *, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None) -> torch._ops.OpOverload:
    """Register `grpo_fast::<name>` with `schema` ("(Tensor x, ...) -> Tensor"): `kernel` for every
    device (CompositeExplicitAutograd, like custom_op without device_types), its fake (meta)
    implementation and, when given, its autograd formula. Returns the op (`torch.ops.grpo_fast.<name>.default`)."""
    qualname = f"{NAMESPACE}::{name}"
    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, _dynamo_disabled_once_loaded(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default

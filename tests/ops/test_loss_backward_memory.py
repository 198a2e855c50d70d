"""The loss op's backward allocates nothing of the parameters' size: it scales the gradients its
forward computed, in place, and autograd hands it no zero gradients for the other outputs (metrics,
the gradients themselves). Those zeros were a [V, H] and an [N, H] buffer at the peak: +68 MB at
B4 T512 H512 V32k fp32 (bench_loss.py's first-call figure, 0.16x -> 0.13x plain PyTorch's)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_fast.ops import fused_linear_grpo_loss
from tests.ops.cases import backend_params


class _NewTensors(TorchDispatchMode):
    """Records (op, shape) of every tensor an op returns in new storage (an allocation, not a view)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storages = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                    if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:  # not a view
                self.made.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("backend", backend_params(triton=False))
def test_loss_backward_allocates_no_parameter_sized_buffer(backend):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g).requires_grad_(True)
    weight = (torch.randn(40, 16, generator=g) * 0.25).requires_grad_(True)
    target, advantages, mask = torch.randint(0, 40, (2, 6), generator=g), torch.randn(2, generator=g), torch.ones(2, 6)
    loss, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, backend=backend)
    with _NewTensors() as mode:
        loss.backward()
    big = [(op, shape) for op, shape in mode.made if shape in (tuple(weight.shape), tuple(hidden.shape))]
    assert not big, f"backward allocated {len(big)} parameter-sized tensors: {big}"
    assert weight.grad is not None and hidden.grad is not None

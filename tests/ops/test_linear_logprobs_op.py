"""`fused_linear_logprobs` equals `objective.token_logprobs` on float64 logits: values, entropy,
and gradients under a random (non-uniform) upstream gradient, for 3-D and 1-D leading shapes."""

from __future__ import annotations

import pytest
import torch

from grpo_fast import objective
from grpo_fast.objective import LogitMap
from grpo_fast.ops import fused_linear_logprobs
from tests.helpers import assert_close, plain_bound, scaled
from tests.ops.cases import backend_params


def _inputs(lead, H, V, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 * H**-0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, V, lead, generator=g)
    grad_out = torch.randn(lead, generator=g)
    return hidden, weight, b, target, grad_out


def _leaves(*tensors, dtype=None):
    return [None if t is None else (t if dtype is None else t.to(dtype)).clone().requires_grad_(True) for t in tensors]


def _reference(hidden, weight, bias, target, temperature, grad_out, plain=False):
    """token_logprobs on float64 logits; grads of sum(grad_out * logp) w.r.t. float64 copies.
    plain=True: logits by a matmul in the input dtype, as plain PyTorch would compute them."""
    h, w, b = _leaves(hidden, weight, bias, dtype=None if plain else torch.float64)
    logits = h @ w.t() if b is None else h @ w.t() + b
    logp, entropy = objective.token_logprobs(logits, target, temperature)
    (logp * grad_out).sum().backward()
    return logp.detach(), entropy.detach(), [None if t is None else t.grad for t in (h, w, b)]


SHAPES = {  # leading shape, H, V, dtype, bias
    "3d": ((2, 3, 4), 16, 37, torch.float32, True),
    "1d": ((7,), 12, 131, torch.float32, False),
    "V5": ((2, 5), 8, 5, torch.float32, True),
    "one_token": ((1,), 16, 37, torch.float32, False),
    "bf16_3d": ((2, 2, 3), 16, 131, torch.bfloat16, True),
}
# Every quantity is allowed 4 x the error plain PyTorch makes in the input dtype (logits by a matmul in
# that dtype, measured live) plus a floor times (1 + max |expected|), as in test_fused_ops.py: both
# scale with the values (grad weight reaches 9 here, where an fp32 ulp is 1e-6 and the CPU's summation
# order moves results by a few of those). Measured max abs against the float64 spec: float32, plain
# 1e-7 to 2.3e-6 and the backends 7e-8 to 4.7e-6 (1d grad weight, bound 2.9e-5); bf16, plain 1.6e-2
# on logp and 8e-3 to 1.6e-2 on grads, the backends 5e-3 to 5.5e-2 (bounds 8e-2 to 1.3e-1).
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-3}


def _atol(expected, plain, dtype):
    return plain_bound(expected, plain, floor=FLOOR[dtype])


# the Triton interpreter is slow: two shapes for it (its own tests in tests/kernels cover more)
PARAMS = [(b, s) for b in backend_params() for s in SHAPES if b.id != "triton" or s in ("3d", "bf16_3d")]


@pytest.mark.parametrize("backend,shape", [pytest.param(b.values[0], s, marks=b.marks, id=f"{b.id}-{s}") for b, s in PARAMS])
def test_values_entropy_and_grads(backend, shape):
    lead, H, V, dtype, bias = SHAPES[shape]
    hidden, weight, b, target, grad_out = _inputs(lead, H, V, dtype, bias)
    temperature = 0.7
    ref_logp, ref_entropy, ref_grads = _reference(hidden, weight, b, target, temperature, grad_out)
    plain_logp, plain_entropy, plain_grads = _reference(hidden, weight, b, target, temperature, grad_out, plain=True)

    h, w, bb = _leaves(hidden, weight, b)
    logp, entropy = fused_linear_logprobs(h, w, target, bias=bb, temperature=temperature, return_entropy=True, backend=backend)
    assert logp.shape == lead and entropy.shape == lead and logp.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad
    (logp * grad_out).sum().backward()

    assert_close(logp, ref_logp, atol=_atol(ref_logp, plain_logp, dtype), name=f"{backend} logp")
    assert_close(entropy, ref_entropy, atol=_atol(ref_entropy, plain_entropy, dtype), name=f"{backend} entropy")
    for what, leaf, ref, plain in zip(("hidden", "weight", "bias"), (h, w, bb), ref_grads, plain_grads, strict=True):
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == dtype, what
        assert_close(leaf.grad, ref, atol=_atol(ref, plain, dtype), name=f"{backend} grad {what}")


@pytest.mark.parametrize("backend", backend_params(triton=False))
def test_logp_only_and_partial_grads(backend):
    """return_entropy=False returns just logp; only hidden requires grad -> weight gets none."""
    hidden, weight, _, target, grad_out = _inputs((3, 4), 8, 37, torch.float32, False)
    h = hidden.clone().requires_grad_(True)
    logp = fused_linear_logprobs(h, weight, target, backend=backend)
    ref_logp, _, (ref_h, _, _) = _reference(hidden, weight, None, target, 1.0, grad_out)
    plain_logp, _, (plain_h, _, _) = _reference(hidden, weight, None, target, 1.0, grad_out, plain=True)
    (logp * grad_out).sum().backward()
    assert_close(logp, ref_logp, atol=_atol(ref_logp, plain_logp, torch.float32), name="logp")
    assert_close(h.grad, ref_h, atol=_atol(ref_h, plain_h, torch.float32), name="grad hidden")
    assert weight.grad is None


def test_chunking_does_not_change_results():
    """Several chunks (and a ragged last one) give the one-chunk answer: the loop is exact."""
    from grpo_fast.ops import row_ops

    hidden, weight, b, target, grad_out = _inputs((11,), 8, 37, torch.float32, True)
    ops = row_ops.TORCH_ROW_OPS
    one = row_ops.forward(ops, hidden, weight, b, target, LogitMap(0.7))
    many = row_ops.forward(ops, hidden, weight, b, target, LogitMap(0.7), chunk_size=4)
    for a, c in zip(one, many, strict=True):
        assert_close(c, a, atol=scaled(1e-6, a), name="forward")
    g1 = row_ops.backward(ops, hidden, weight, b, target, one[2], grad_out, LogitMap(0.7))
    g4 = row_ops.backward(ops, hidden, weight, b, target, one[2], grad_out, LogitMap(0.7), chunk_size=4)
    for a, c in zip(g1, g4, strict=True):
        assert_close(c, a, atol=scaled(1e-6, a), name="backward")

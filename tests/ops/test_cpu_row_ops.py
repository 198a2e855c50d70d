"""The C++ row passes of the cpu backend (csrc/row_ops.cpp) against float64 PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_close, magnitude

_C = pytest.importorskip("grpo_fast._C", reason="the native extension is not built")
from grpo_fast.objective import LogitMap  # noqa: E402
from grpo_fast.ops import cpu  # noqa: E402


def test_exp_approx_accuracy():
    """The vectorised exp is within 2 ulp-ish (rel 2e-7) of exp over the range the passes use."""
    x = torch.cat([torch.linspace(-87.0, 0.0, 400_001), torch.tensor([-1e-8, -0.3465736, 0.3465736, 1.0, 5.0])])
    y = x.clone()
    _C.exp_approx_(y.data_ptr(), y.numel())
    rel = ((y.double() - x.double().exp()) / x.double().exp()).abs()
    assert float(rel.max()) < 2e-7, f"max relative error {float(rel.max()):.3g} at x={float(x[rel.argmax()])}"


def test_exp_approx_edges():
    x = torch.tensor([float("nan"), -float("inf"), -1000.0, -87.4, 0.0])
    _C.exp_approx_(x.data_ptr(), x.numel())
    assert math.isnan(x[0]) and x[1:4].eq(0).all() and x[4] == 1.0, x


def _reference_stats(logits, target, logit_map):
    z = logit_map(logits.double())
    logp_all = torch.log_softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    return logp_all.gather(-1, target[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1), lse


# a bare temperature; a model's scale (Cohere); a scale and Gemma 2's soft-cap (30), before the temperature
MAPS = {"temperature": LogitMap(0.7), "scale": LogitMap(0.7, scale=0.25),
        "softcap": LogitMap(0.7, scale=1.5, softcap=30.0)}


def _z_error(logits, logit_map):
    """The passes' error in z: an ulp of |z| from the float32 map (pre * x), and with soft-capping
    also tanh through the vectorised exp (absolute ~2.5e-7 of tanh, times post): 2 resp. 4 ulps of |z|."""
    z_ulp = torch.finfo(torch.float32).eps * max(1.0, float(logit_map(logits.double()).abs().max()))
    return (2 if logit_map.softcap is None else 4) * z_ulp


@pytest.mark.parametrize("logit_map", MAPS.values(), ids=MAPS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 37, 1031])
def test_stats_and_grad(dtype, vocab, logit_map):
    g = torch.Generator().manual_seed(vocab)
    rows = 9  # more rows than threads, odd
    # offset 60: z up to ~90, where exp without the max shift overflows float32 at vocab 1031
    logits = (torch.randn(rows, vocab, generator=g) * 4 + 60).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    logp, entropy, lse = cpu._stats(logits, target, logit_map)
    x = logits.double().requires_grad_(True)
    ref = _reference_stats(x, target, logit_map)
    # the passes' error is set by the inputs' size, not the outputs': z carries an ulp of |z| (~90
    # here: eps |z| = 1.1e-5) into logp, entropy and lse alike (see _z_error), + 1e-6 relative
    z_err = _z_error(logits, logit_map)
    for name, got, exp in zip(("logp", "entropy", "lse"), (logp, entropy, lse), ref, strict=True):
        assert_close(got, exp.detach(), atol=z_err, rtol=1e-6, name=name)

    upstream = torch.randn(rows, generator=g)
    grad = cpu._grad_(logits.clone(), target, lse, upstream, logit_map)  # lse of the pass, as in use
    (expected,) = torch.autograd.grad((upstream.double() * ref[0]).sum(), x)
    # f32: z carries its error into p: that x the gradients' size, where 1 - p cancels;
    # bf16 output: one rounding of each entry (rel 2^-8)
    atol = z_err * magnitude(expected)
    assert_close(grad, expected, atol=atol, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-5, name="grad")


@pytest.mark.parametrize("top", [6.0, 20.0])
def test_bf16_target_entry_is_one_minus_p_in_fp32(top):
    """At a confident target, g (1 - p) is computed in fp32 and rounded once: rounding p to bf16
    first (granularity 2^-8 near 1) would make 1 - p = 0.0074 come out as 0.0078 or 0.0039."""
    logits = torch.tensor([[top, 0.0, 0.0, 0.0]]).bfloat16()
    target = torch.tensor([0])
    _, _, lse = cpu._stats(logits, target, LogitMap())
    grad = cpu._grad_(logits.clone(), target, lse, torch.ones(1), LogitMap())
    one_minus_p = 1 - torch.softmax(logits.double(), -1)[0, 0]
    # one bf16 rounding of the result (2^-9 relative), plus float32's own absolute error on 1 - p
    assert_close(grad[0, 0], one_minus_p, atol=1.2e-7, rtol=2**-9, name="g (1 - p) at the target")


@pytest.mark.parametrize("logit_map", [MAPS["temperature"], LogitMap(0.7, scale=1.5, softcap=5.0)],
                         ids=["temperature", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 37, 1007])
def test_grad_with_entropy_term(dtype, vocab, logit_map):
    """The entropy bonus's row pass: d(sum g logp + g_h H)/d(logits) against float64 autograd, with
    rows where g or g_h is 0, temperature != 1 (and soft-capping) and a vocab that is no multiple of the SIMD width."""
    g = torch.Generator().manual_seed(vocab + 1)
    rows = 7
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    if logit_map.softcap is not None:
        logits = logits * 3  # pre x = 0.3 x up to ~8: across tanh's bend into saturation, |z| <= 7
    target = torch.randint(0, vocab, (rows,), generator=g)
    upstream, g_entropy = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    upstream[1], g_entropy[2] = 0.0, 0.0
    _, entropy, lse = cpu._stats(logits, target, logit_map)
    grad = cpu._grad_(logits.clone(), target, lse, upstream, logit_map, g_entropy, entropy)

    x = logits.double().requires_grad_(True)
    logp_ref, entropy_ref, _ = _reference_stats(x, target, logit_map)
    (expected,) = torch.autograd.grad((upstream.double() * logp_ref + g_entropy.double() * entropy_ref).sum(), x)
    # as test_stats_and_grad: a few ulps of |z| times the gradients' size (here also |log p| ~ up to
    # 10 in the entropy term), bf16 output rounded once
    z_err = _z_error(logits, logit_map)
    atol = 8 * z_err * magnitude(expected)
    assert_close(grad, expected, atol=atol, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-5, name="grad with entropy")
    plain = cpu._grad_(logits.clone(), target, lse, upstream, logit_map)
    zero_h = cpu._grad_(logits.clone(), target, lse, upstream, logit_map, torch.zeros(rows), entropy)
    assert_close(zero_h, plain, atol=z_err * magnitude(plain), rtol=1e-6, name="g_h = 0 is the plain pass")
    if vocab > 1:
        change = (grad.float() - plain.float()).abs().max()
        assert change > 10 * atol, "the entropy term must change the gradient (by more than the tolerance)"

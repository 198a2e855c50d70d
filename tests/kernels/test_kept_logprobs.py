"""Triton kept-set kernels (kernels/kept_logprobs.py) against the `torch` kept route and the spec.

Through Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1), tiny shapes: sets that span
several id tiles and a ragged last one, H not a multiple of the H block, the soft-cap and the entropy's
gradient; the fused path's callback sees every position's log-probs once. Values and gradients against the
spec are tests/ops/test_kept.py's (through the ops, every backend).
"""

from __future__ import annotations

import pytest
import torch

from grpo_fast.kernels import kept_logprobs as KK
from grpo_fast.objective import KeptSets, LogitMap
from grpo_fast.ops import kept
from tests.helpers import assert_close, scaled
from tests.ops.test_kept import KeptCase, make_inputs, make_sets


def _route(fn, *args, **kwargs):
    return fn(kept.TORCH_KEPT_OPS, *args, **kwargs)


def test_kernels_match_the_torch_route():
    case = KeptCase(n=7, hidden=40, vocab=90, k=37, softcap=2.5, logit_scale=1.5)  # 3 id tiles of 16, H tail
    h, w, b, target, g, g_h, _ = make_inputs(case)
    sets = make_sets(case, target)
    logit_map = LogitMap(case.temperature, case.logit_scale, case.softcap)
    fwd = KK.kept_forward(h, w, b, target, sets, logit_map)
    ref = _route(kept.forward, h, w, b, target, sets, logit_map)
    for name, got, exp in zip(("logp", "entropy", "lse"), fwd, ref, strict=True):
        assert_close(got, exp, atol=scaled(2e-6, exp), name=f"forward {name}")

    bwd = KK.kept_backward(h, w, b, target, sets, fwd[2], g, logit_map, grad_entropy=g_h, entropy=fwd[1])
    ref_bwd = _route(kept.backward, h, w, b, target, sets, ref[2], g, logit_map, grad_entropy=g_h, entropy=ref[1])
    calls = []

    def dloss_dlogp(start, end, logp):  # a loss whose gradient depends on the log-probs
        calls.append((start, end))
        return g[start:end] + 0.25 * logp

    fused = KK.kept_fused(h, w, b, target, sets, logit_map, dloss_dlogp, grad_entropy=g_h)
    ref_fused = _route(kept.fused, h, w, b, target, sets, logit_map, lambda s, e, lp: g[s:e] + 0.25 * lp,
                       grad_entropy=g_h)
    assert calls == [(0, case.n)]
    for label, got, exp in (("backward", bwd, ref_bwd), ("fused", fused[2:], ref_fused[2:])):
        for name, x, y in zip(("grad_hidden", "grad_weight", "grad_bias"), got, exp, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert_close(x, y, atol=scaled(2e-6, y), name=f"{label} {name}")


def test_only_what_is_needed_and_no_positions():
    case = KeptCase(n=5, bias=False)
    h, w, _, target, g, _, _ = make_inputs(case)
    sets = make_sets(case, target)
    logit_map = LogitMap(case.temperature)
    _, _, lse = KK.kept_forward(h, w, None, target, sets, logit_map)
    gh, gw, gb = KK.kept_backward(h, w, None, target, sets, lse, g, logit_map, needs=(True, False, False))
    assert gw is None and gb is None and gh.shape == h.shape
    all_h, *_ = KK.kept_backward(h, w, None, target, sets, lse, g, logit_map)
    assert_close(gh, all_h, atol=0.0, name="grad_hidden alone vs all")
    empty = KeptSets.none(0)
    out = KK.kept_forward(h[:0], w, None, target[:0], empty, logit_map)
    assert all(t.shape == (0,) for t in out)


# ---------------------------------------------------------------------------------------------
# GPU twins: compiled kernels at a real head's size (skipped without CUDA)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_match_the_torch_route_gpu(dtype):
    """Qwen2.5-0.5B's head, k = 512 random ids a position (most ids kept by several positions: the
    atomics meet): the kernels against the torch route on the same GPU, which takes the same fp32 products."""
    n, hdim, vocab, k = 1024, 896, 151936, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hdim, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(vocab, hdim, device="cuda", generator=gen) * 0.05).to(dtype)
    b = (torch.randn(vocab, device="cuda", generator=gen) * 0.1).to(dtype)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    ids = torch.rand(n, vocab, device="cuda", generator=gen).topk(k, dim=-1).indices
    has = (ids == target[:, None]).any(-1)
    ids[~has, 0] = target[~has]
    sets = KeptSets(ids.reshape(-1).contiguous(), torch.arange(n + 1, device="cuda") * k)
    g = torch.randn(n, device="cuda", generator=gen)
    logit_map = LogitMap(0.7, 1.0, 30.0)
    fwd = KK.kept_forward(h, w, b, target, sets, logit_map)
    ref = _route(kept.forward, h, w, b, target, sets, logit_map)
    for name, got, exp in zip(("logp", "entropy", "lse"), fwd, ref, strict=True):
        assert_close(got, exp, atol=scaled(2e-5, exp), name=f"forward {name}")
    got = KK.kept_backward(h, w, b, target, sets, fwd[2], g, logit_map)
    exp = _route(kept.backward, h, w, b, target, sets, ref[2], g, logit_map)
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the two round their fp32 sums to bf16 once each
    for name, x, y in zip(("grad_hidden", "grad_weight", "grad_bias"), got, exp, strict=True):
        assert_close(x.float(), y.float(), atol=scaled(tol, y.float()), name=name)

"""Triton `linear_logprobs` kernels against the specification (`objective.token_logprobs` on
materialised float64 logits) and the `torch` backend.

On the CPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny
shapes chosen to hit every edge: vocabulary and hidden tails, one token, several splits and chunks.
The `gpu` tests are their CUDA twins on larger shapes (compiled kernels, real tile sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from grpo_fast import objective
from grpo_fast.kernels import linear_logprobs as K
from grpo_fast.objective import LogitMap
from grpo_fast.ops import backends
from tests.helpers import assert_close, scaled

gpu = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    n: int
    vocab: int
    hidden: int
    dtype: torch.dtype = torch.float32
    bias: bool = True
    temperature: float = 1.0
    chunk_size: Optional[int] = None  # None: the workspace budget decides
    entropy_grad: bool = False  # the entropy bonus: also d(loss)/d(entropy) per token into the gradient passes
    logit_scale: float = 1.0  # the model's own logit map before the temperature (objective.LogitMap)
    softcap: Optional[float] = None

    @property
    def logit_map(self) -> LogitMap:
        return LogitMap(self.temperature, self.logit_scale, self.softcap)


def entropy_grad_of(case: Case, n: int, device) -> Optional[torch.Tensor]:
    """d(loss)/d(entropy) per token (None unless case.entropy_grad), some rows 0."""
    if not case.entropy_grad:
        return None
    gh = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.7
    gh[::3] = 0.0
    return gh.to(device)


def make_inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(case.n, case.hidden, generator=gen)
    w = torch.randn(case.vocab, case.hidden, generator=gen) * (2.0 / case.hidden) ** 0.5 * 2
    b = torch.randn(case.vocab, generator=gen) if case.bias else None
    target = torch.randint(0, case.vocab, (case.n,), generator=gen)
    g = torch.randn(case.n, generator=gen) * torch.rand(case.n, generator=gen) * 3  # differs per token
    to = lambda t: None if t is None else t.to(device=device, dtype=case.dtype)
    return to(h), to(w), to(b), target.to(device), g.to(device)


def _logprobs(logits, target, logit_map):
    return objective.token_logprobs(logits, target, logit_map.temperature, logit_scale=logit_map.scale,
                                    logit_softcap=logit_map.softcap)


def reference(h, w, b, target, logit_map, g, gh=None):
    """The spec on float64 logits: (logp, entropy, lse) and grads of sum(g * logp [+ gh * entropy])
    w.r.t. h, w, b."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (h, w, b)]
    h64, w64, b64 = leaves
    logits = h64 @ w64.t() + (b64 if b64 is not None else 0.0)
    logp, entropy = _logprobs(logits, target, logit_map)
    lse = torch.logsumexp(logit_map(logits.detach()), dim=-1)
    objective_ = (logp * g.double()).sum() + (0.0 if gh is None else (entropy * gh.double()).sum())
    grads = torch.autograd.grad(objective_, [t for t in leaves if t is not None])
    grads = list(grads) + [None] * (3 - len(grads))
    return logp.detach(), entropy.detach(), lse, grads


def plain_pytorch(h, w, b, target, logit_map, g, gh=None):
    """Plain PyTorch in the inputs' dtype (materialised logits): the yardstick for tolerances."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if leaves[2] is not None else 0.0)
    logp, entropy = _logprobs(logits, target, logit_map)
    objective_ = (logp * g).sum() + (0.0 if gh is None else (entropy * gh).sum())
    grads = torch.autograd.grad(objective_, [t for t in leaves if t is not None])
    return logp.detach(), entropy.detach(), list(grads) + [None] * (3 - len(grads))


def tolerance(name, case, plain, expected):
    """fp32: 2e-5 x max(1, |expected|); bf16/fp16: 2x the error plain PyTorch makes in that dtype, plus a floor."""
    if case.dtype == torch.float32:
        return scaled(2e-5, expected)
    plain_err = float((plain.double() - expected.double()).abs().max())
    return 2.0 * plain_err + 2e-3 * max(1.0, float(expected.abs().max()))


def check_case(case: Case, device: str):
    h, w, b, target, g = make_inputs(case, device)
    gh = entropy_grad_of(case, case.n, device)
    T = case.logit_map
    ref_logp, ref_entropy, ref_lse, ref_grads = reference(h, w, b, target, T, g, gh)
    plain_logp, plain_entropy, plain_grads = plain_pytorch(h, w, b, target, T, g, gh)

    logp, entropy, lse = K.forward(h, w, b, target, T)
    for name, got, exp, pl in [("logp", logp, ref_logp, plain_logp), ("entropy", entropy, ref_entropy, plain_entropy),
                               ("lse", lse, ref_lse, ref_lse)]:
        assert got.dtype == torch.float32 and got.shape == (case.n,)
        assert_close(got, exp, atol=tolerance(name, case, pl, exp), name=f"forward {name}")

    calls = []

    def dloss_dlogp(start, end, logp_chunk):  # a loss whose gradient depends on the log-probs
        calls.append((start, end))
        return g[start:end] + 0.25 * logp_chunk

    g_fused = g + 0.25 * ref_logp.to(g.device).float()
    _, _, _, ref_grads_fused = reference(h, w, b, target, T, g_fused, gh)
    _, _, plain_grads_fused = plain_pytorch(h, w, b, target, T, g_fused, gh)

    with_entropy = {} if gh is None else dict(grad_entropy=gh, entropy=entropy)
    grads_bwd = K.backward(h, w, b, target, lse, g, T, chunk_size=case.chunk_size, **with_entropy)
    f_logp, f_entropy, *grads_fused = K.fused(h, w, b, target, T, dloss_dlogp, chunk_size=case.chunk_size,
                                              **({} if gh is None else dict(grad_entropy=gh)))
    assert_close(f_logp, ref_logp, atol=tolerance("logp", case, plain_logp, ref_logp), name="fused logp")
    assert_close(f_entropy, ref_entropy, atol=tolerance("entropy", case, plain_entropy, ref_entropy), name="fused entropy")
    # the callback saw every chunk once, in order
    assert calls[0][0] == 0 and calls[-1][1] == case.n and all(a[1] == c[0] for a, c in zip(calls, calls[1:], strict=False))

    for label, got_grads, exp_grads, pl_grads in [("backward", grads_bwd, ref_grads, plain_grads),
                                                  ("fused", grads_fused, ref_grads_fused, plain_grads_fused)]:
        for name, got, exp, pl, param in zip(("grad_hidden", "grad_weight", "grad_bias"), got_grads, exp_grads,
                                             pl_grads, (h, w, b), strict=True):
            if param is None:
                assert got is None, f"{label} {name}: expected None without a bias"
                continue
            assert got.dtype == param.dtype and got.shape == param.shape, f"{label} {name}: {got.dtype} {got.shape}"
            assert_close(got, exp, atol=tolerance(name, case, pl, exp), name=f"{label} {name}")

    if case.dtype == torch.float32:  # the torch backend agrees too (same fp32 math, other route; 2e-5 x their size)
        t_logp, t_entropy, t_lse = backends.get("torch").forward(h, w, b, target, T)
        assert_close(logp, t_logp, atol=scaled(2e-5, t_logp), name="logp vs torch backend")
        assert_close(entropy, t_entropy, atol=scaled(2e-5, t_entropy), name="entropy vs torch backend")
        t_grads = backends.get("torch").backward(h, w, b, target, t_lse, g, T,
                                                 **({} if gh is None else dict(grad_entropy=gh, entropy=t_entropy)))
        for name, got, exp in zip(("grad_hidden", "grad_weight", "grad_bias"), grads_bwd, t_grads, strict=True):
            if exp is not None:
                assert_close(got, exp, atol=scaled(2e-5, exp), name=f"{name} vs torch backend")


# ---------------------------------------------------------------------------------------------
# CPU: through the interpreter (block 16), tiny shapes
# ---------------------------------------------------------------------------------------------

CPU_CASES = {
    # V=37, H=40: tails in both tiled dims; chunks of 3 rows; several forward splits; temperature
    "fp32-tails-bias-temp": Case(n=7, vocab=37, hidden=40, bias=True, temperature=0.7, chunk_size=3),
    "fp32-one-token-V5": Case(n=1, vocab=5, hidden=16, bias=False),
    # bf16 with H a multiple of the block (the unmasked-H path), N=19 spans two row blocks
    "bf16-bias-temp": Case(n=19, vocab=50, hidden=32, dtype=torch.bfloat16, bias=True, temperature=1.3, chunk_size=8),
    # the entropy bonus's gradient term in the backward and in the fused gradient kernel, over chunks
    "fp32-entropy-grad": Case(n=7, vocab=37, hidden=40, bias=True, temperature=0.7, chunk_size=3, entropy_grad=True),
    "bf16-entropy-grad": Case(n=19, vocab=50, hidden=32, dtype=torch.bfloat16, bias=False, chunk_size=8,
                              entropy_grad=True),
    # the model's logit map: Gemma 2's soft-cap (small enough here to bend the logits) with a scale, and
    # with the entropy's gradient; a scale alone (Cohere)
    "fp32-softcap": Case(n=7, vocab=37, hidden=40, bias=True, temperature=0.7, chunk_size=3, logit_scale=1.5,
                         softcap=3.0, entropy_grad=True),
    "bf16-softcap": Case(n=19, vocab=50, hidden=32, dtype=torch.bfloat16, bias=True, chunk_size=8, softcap=2.5),
    "fp32-scale": Case(n=7, vocab=37, hidden=40, bias=False, temperature=1.3, logit_scale=0.25),
}


@pytest.mark.parametrize("splits", ["many", "one"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_matches_reference(name, splits, monkeypatch):
    if splits == "one":  # every vocabulary tile in one program: the online rescaling across tiles
        monkeypatch.setattr(K, "PROGRAMS_PER_SM", 0)
    check_case(CPU_CASES[name], "cpu")


def test_each_role_uses_its_own_tiles(monkeypatch):
    """Forward, fused and backward get different tile shapes (as on a GPU): the fused path's tile
    maxima and gradient kernel must follow the fused role's tiles, not the forward's. The fused
    role stores its tiles with plain stores here (the other tests use the TMA descriptor)."""
    roles = {"forward": (16, 32), "fused": (32, 16), "backward": (16, 64)}

    def per_role(dtype, role):
        block_n, block_v = roles[role]
        return K.LaunchConfig(block_n=block_n, block_v=block_v, block_k=16, num_warps=1, num_stages=1, tma_store=False)

    monkeypatch.setattr(K, "launch_config", per_role)
    monkeypatch.setattr(K, "TO_GRAD_ELEMENTS", 16 * 16)  # the gradient kernel: 16-row blocks of the fused 32 x 16 tiles
    assert K.to_grad_rows(per_role(None, "fused")) == 16
    check_case(Case(n=37, vocab=70, hidden=40, bias=True, temperature=0.7, chunk_size=20), "cpu")
    check_case(Case(n=19, vocab=50, hidden=32, dtype=torch.bfloat16, bias=False, chunk_size=8), "cpu")


def test_confident_token_gradient_keeps_1_minus_p():
    """p(target) = 1 - 1e-4: in bf16, 1 - p rounds to 0; the kernels form it in fp32."""
    n, vocab, hd = 4, 20, 16
    h = torch.zeros(n, hd)
    h[:, 0] = 1.0
    w = torch.zeros(vocab, hd)
    target = torch.tensor([3, 7, 3, 11])
    w[target, 0] = 12.0  # target logit 12 above the 19 others: 1 - p = 19 e^-12 / (...) ~ 1.2e-4
    w[:, 0] += torch.linspace(0, 0.5, vocab)  # and not all equal
    bias = torch.zeros(vocab)
    h, w, bias = (t.bfloat16() for t in (h, w, bias))
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    logp, _, lse = K.forward(h, w, bias, target, LogitMap())
    *_, ref_grads = reference(h, w, bias, target, LogitMap(), g)
    for label, grads in [("backward", K.backward(h, w, bias, target, lse, g, LogitMap())),
                         ("fused", K.fused(h, w, bias, target, LogitMap(), lambda s, e, lp: g[s:e])[2:])]:
        gb = grads[2].double()
        exp = ref_grads[2]
        for col in (3, 7, 11):  # relative error of g (1 - p) at the target columns
            rel = abs(gb[col] - exp[col]) / abs(exp[col])
            assert exp[col].abs() > 1e-5 and rel < 1e-2, f"{label} grad_bias[{col}]: got {gb[col]:.4g}, expected {exp[col]:.4g}"


def test_soft_capped_target_in_saturation_keeps_its_slope():
    """A target soft-capped near -post: its gradient g (1 - p) dz/dr rides on the slope post + z, which
    cancels there; the fused path's bf16 slab holds z - max with an error of |z - max| 2^-9, as large as
    that slope, so the target's own logit comes from the forward's fp32 sums instead."""
    n, vocab, hd = 4, 20, 16
    logit_map = LogitMap(1.0, scale=1.0, softcap=2.5)
    h = torch.zeros(n, hd)
    h[:, 0] = 1.0
    w = torch.zeros(vocab, hd)
    w[:, 0] = torch.linspace(0.0, 8.0, vocab)  # z from 0 up to 2.5 tanh(3.2): up into the positive bend
    target = torch.tensor([3, 7, 3, 11])
    w[target, 0] = -9.0  # the targets: tanh(-3.6) = -0.9985, slope pre post (1 - tanh^2) ~ 3e-3 of its peak
    h, w, bias = (t.bfloat16() for t in (h, w, torch.zeros(vocab)))
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    *_, ref_grads = reference(h, w, bias, target, logit_map, g)
    for label, grads in [("fused", K.fused(h, w, bias, target, logit_map, lambda s, e, lp: g[s:e])[2:]),
                         ("backward", K.backward(h, w, bias, target, K.forward(h, w, bias, target, logit_map)[2], g,
                                                 logit_map))]:
        gb, exp = grads[2].double(), ref_grads[2]
        for col in (3, 7, 11):  # one bf16 rounding of the result and of the inputs' logits (2^-8 relative each)
            rel = abs(gb[col] - exp[col]) / abs(exp[col])
            assert rel < 2e-2, f"{label} grad_bias[{col}]: got {gb[col]:.4g}, expected {exp[col]:.4g}"


def test_backward_only_what_is_needed():
    case = CPU_CASES["fp32-tails-bias-temp"]
    h, w, b, target, g = make_inputs(case, "cpu")
    _, _, lse = K.forward(h, w, b, target, case.logit_map)
    gh, gw, gb = K.backward(h, w, b, target, lse, g, case.logit_map, needs=(True, False, False))
    assert gw is None and gb is None and gh.shape == h.shape
    gh_all, *_ = K.backward(h, w, b, target, lse, g, case.logit_map)
    assert_close(gh, gh_all, atol=0.0, name="grad_hidden alone vs all")


def test_grid_is_one_dimensional_for_a_million_tokens():
    """N on grid axis 0 only (axes 1 and 2 stop at 65535): computed, not launched."""
    n, vocab = 1_000_000, 151936
    configs = [cfg for roles in K.GPU_CONFIGS.values() for cfg in (roles.forward, roles.fused, roles.backward)]
    for cfg in configs:
        grid, splits, per_split = K.fwd_grid(n, vocab, cfg, num_sms=132)
        row_blocks = -(-n // cfg.block_n)
        assert len(grid) == 1 and grid[0] == row_blocks * splits < 2**31, (cfg, grid)
        assert splits * per_split >= -(-vocab // cfg.block_v) > (splits - 1) * per_split  # every tile, no empty split
        (programs,) = K.tile_grid(n, vocab, cfg)
        assert programs == row_blocks * -(-vocab // cfg.block_v) < 2**31
    # small N: the vocabulary is split to fill the GPU
    cfg = K.GPU_CONFIGS[torch.bfloat16].forward
    grid, splits, per_split = K.fwd_grid(16, vocab, cfg, num_sms=132)
    assert grid == (splits,) and splits >= 132 and splits * per_split >= -(-vocab // cfg.block_v)


def test_empty_input():
    h, w = torch.zeros(0, 16), torch.randn(5, 16)
    logp, entropy, lse = K.forward(h, w, None, torch.zeros(0, dtype=torch.int64), LogitMap())
    assert logp.shape == entropy.shape == lse.shape == (0,)


# ---------------------------------------------------------------------------------------------
# GPU twins: compiled kernels, real tile sizes (128), larger shapes
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "fp32-tails-bias-temp": Case(n=300, vocab=1037, hidden=200, bias=True, temperature=0.7, chunk_size=128),
    "fp32-one-token-V5": Case(n=1, vocab=5, hidden=16, bias=False),
    "bf16-tails-chunks": Case(n=1000, vocab=32017, hidden=512, dtype=torch.bfloat16, bias=True, temperature=1.3,
                              chunk_size=384),
    "bf16-qwen-vocab": Case(n=2048, vocab=151936, hidden=896, dtype=torch.bfloat16, bias=False),
    "fp16-odd-hidden": Case(n=257, vocab=4099, hidden=136, dtype=torch.float16, bias=True, temperature=0.9),
    "bf16-entropy-grad": Case(n=1000, vocab=32017, hidden=512, dtype=torch.bfloat16, bias=True, temperature=0.9,
                              chunk_size=384, entropy_grad=True),
}


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_matches_reference_gpu(name):
    check_case(GPU_CASES[name], "cuda")


@gpu
def test_int64_offsets_gpu():
    """N * H > 2**31: row offsets must not wrap. Checks the last rows against fp32 logits."""
    hd, vocab = 4096, 200
    n = (1 << 31) // hd + 3000
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(vocab, hd, device="cuda", generator=gen) * 0.03).bfloat16()
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    logp, _, lse = K.forward(h, w, None, target, LogitMap())
    gh, _, _ = K.backward(h, w, None, target, lse, g, LogitMap(), needs=(True, False, False))
    tail = slice(n - 4096, n)
    logits = h[tail].float() @ w.float().t()
    exp_logp = torch.log_softmax(logits, -1).gather(-1, target[tail, None]).squeeze(-1)
    assert_close(logp[tail], exp_logp, atol=scaled(2e-3, exp_logp), name="logp of the last rows")
    p = torch.softmax(logits, -1)
    dz = g[tail, None] * (torch.nn.functional.one_hot(target[tail], vocab).float() - p)
    exp_gh = dz @ w.float()
    assert_close(gh[tail].float(), exp_gh, atol=scaled(2e-2, exp_gh), rtol=2e-2, name="grad_hidden of the last rows")


def test_chunks_are_balanced_within_the_workspace():
    """Rows that need two workspaces run as two equal chunks, not a full chunk and a small tail."""
    vocab, budget = 151936, 4 << 30
    step, chunks = K._chunks(16384, vocab, 2, None, budget)
    assert step * vocab * 2 <= budget
    assert chunks == [(0, 8192), (8192, 16384)]
    assert K._chunks(16384, vocab, 2, None, 8 << 30) == (16384, [(0, 16384)])  # an H200's workspace: one chunk
    assert K._chunks(100, vocab, 2, None, budget) == (100, [(0, 100)])
    assert K._chunks(10, vocab, 2, 4, budget)[1] == [(0, 4), (4, 8), (8, 10)]  # an explicit size is kept

"""Kept sets (truncated sampling) in the fused ops, and `linear_topk`, against the specification.

The spec is `objective.token_logprobs(..., kept=)` / `grpo_loss_reference(..., kept=)` on float64 logits of
the same inputs (the log-softmax over each position's kept set); gradients by autograd back to float64
copies of hidden, weight and bias. Tolerances as the other op tests: float32 2e-5 x max(1, the magnitude
compared) (the spec itself rounds its logits to float32); bfloat16 2x the error plain PyTorch makes in
bf16 (the spec fed bf16 matmul logits, measured live) plus 2e-3 x the magnitude. Measured on these cases,
max abs against the float64 spec (values up to ~15): float32, plain 2e-7 to 3e-6, the backends 2e-7 to
3e-6; bfloat16 (a third of the positions on the full-vocabulary route, whose bf16 logit slab is plain's
error), plain 9e-3 to 2.4e-2, the backends 7e-3 to 3.2e-2 (Triton's kept route takes exact fp32 products
of the bf16 operands: 1e-6 on its log-probs).
`linear_topk` equals a stable descending sort of the materialised mapped logits (ties: lower id first), ids
exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from grpo_fast import objective
from grpo_fast.objective import KeptSets, LossOptions
from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs, linear_topk, masked_linear_logprobs
from tests.helpers import assert_close, scaled
from tests.ops.cases import backend_params


@dataclass(frozen=True)
class KeptCase:
    n: int = 9
    hidden: int = 16
    vocab: int = 131  # not a multiple of any tile
    k: int = 20
    dtype: torch.dtype = torch.float32
    bias: bool = True
    temperature: float = 0.7
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    empty_every: int = 0  # every that-many positions has an empty set (the full vocabulary), 0: none
    neighbours: bool = True  # half the sets hold the target's neighbours (target +- 1), the others leave them out
    masked: bool = False  # [3, n / 3] positions and a mask with a fully masked row (the masked op)


def make_sets(case: KeptCase, target: torch.Tensor, seed: int = 3) -> KeptSets:
    """k distinct ids a position, holding its target; with `neighbours`, even positions hold target +- 1 and odd
    ones exclude them (when k leaves room); every `empty_every`-th position empty."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for n, t in enumerate(target.reshape(-1).tolist()):
        if case.empty_every and n % case.empty_every == 0:
            sets.append([])
            continue
        near = {(t - 1) % case.vocab, (t + 1) % case.vocab}
        want_near = case.neighbours and n % 2 == 0 and case.k >= 3
        ids = [t] + (sorted(near) if want_near else [])
        for i in torch.randperm(case.vocab, generator=g).tolist():
            if len(ids) >= case.k:
                break
            if i not in ids and (want_near or case.k >= case.vocab - 2 or i not in near):
                ids.append(i)
        perm = torch.randperm(len(ids), generator=g).tolist()  # the order inside a set is free
        sets.append([ids[i] for i in perm])
    return KeptSets.from_lists(sets)


def make_inputs(case: KeptCase, lead=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = lead or ((3, case.n // 3) if case.masked else (case.n,))
    h = torch.randn(*lead, case.hidden, generator=g).to(case.dtype)
    w = (torch.randn(case.vocab, case.hidden, generator=g) * case.hidden**-0.5 * 2).to(case.dtype)
    b = (torch.randn(case.vocab, generator=g) * 0.5).to(case.dtype) if case.bias else None
    target = torch.randint(0, case.vocab, lead, generator=g)
    g_logp = torch.randn(lead, generator=g)
    g_entropy = torch.randn(lead, generator=g) * 0.5
    mask = None
    if case.masked:
        mask = torch.rand(lead, generator=g) > 0.3
        mask[0] = False  # a fully masked row
    return h, w, b, target, g_logp, g_entropy, mask


def spec(h, w, b, target, case, kept, g_logp, g_entropy, dtype=torch.float64):
    """(logp, entropy, grads of sum(g_logp logp + g_entropy entropy)) of the spec on logits in `dtype`
    (float64: the reference; the input dtype: plain PyTorch, the yardstick of the bf16 tolerance)."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in (h, w, b)]
    logits = leaves[0] @ leaves[1].t() + (0 if leaves[2] is None else leaves[2])
    logp, entropy = objective.token_logprobs(logits, target, case.temperature, logit_scale=case.logit_scale,
                                             logit_softcap=case.softcap, kept=kept)
    total = (logp * g_logp).sum() + (entropy * g_entropy).sum()
    grads = torch.autograd.grad(total, [t for t in leaves if t is not None])
    return logp.detach(), entropy.detach(), list(grads) + [None] * (3 - len(grads))


def tolerance(case, expected, plain):
    if case.dtype == torch.float32:
        return scaled(2e-5, expected)
    return 2.0 * float((plain.double() - expected.double()).abs().max()) + scaled(2e-3, expected)


def run_op(h, w, b, target, case, kept, g_logp, g_entropy, backend, mask=None):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    logp, entropy = masked_linear_logprobs(leaves[0], leaves[1], target, mask, bias=leaves[2],
                                           temperature=case.temperature, logit_scale=case.logit_scale,
                                           logit_softcap=case.softcap, backend=backend, return_entropy=True,
                                           differentiable_entropy=True, kept=kept)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    return logp.detach(), entropy.detach(), [None if t is None else t.grad for t in leaves]


def check(case: KeptCase, backend: str):
    h, w, b, target, g_logp, g_entropy, mask = make_inputs(case)
    kept = make_sets(case, target)
    if mask is not None:  # the spec sees every position; the op only the active ones (their upstream gradient 0)
        g_logp, g_entropy = g_logp * mask, g_entropy * mask
        assert 0 < int(mask.sum()) < mask.numel()
    ref = spec(h, w, b, target, case, kept, g_logp, g_entropy)
    plain = spec(h, w, b, target, case, kept, g_logp, g_entropy, dtype=case.dtype)
    got = run_op(h, w, b, target, case, kept, g_logp, g_entropy, backend, mask)
    active = torch.ones_like(target, dtype=torch.bool) if mask is None else mask
    for name, i in (("logp", 0), ("entropy", 1)):
        exp = torch.where(active, ref[i], 0.0)
        assert_close(got[i], exp, atol=tolerance(case, exp, plain[i]), name=f"{backend} {name}")
    for name, got_g, exp_g, plain_g in zip(("hidden", "weight", "bias"), got[2], ref[2], plain[2], strict=True):
        if exp_g is None:
            assert got_g is None
            continue
        assert got_g.dtype == case.dtype
        assert_close(got_g, exp_g, atol=tolerance(case, exp_g, plain_g), name=f"{backend} grad {name}")


CASES = {
    "k1": KeptCase(k=1),  # log-prob 0, entropy 0, no gradient but through... nothing
    "k20_neighbours": KeptCase(),
    "k512": KeptCase(n=5, vocab=600, k=512, bias=False),
    "whole_vocab_set": KeptCase(n=4, vocab=37, k=37),  # a set of every id: the full-vocabulary values
    "mixed_empty_masked": KeptCase(n=12, empty_every=3, masked=True),
    "softcap_scale": KeptCase(logit_scale=1.5, softcap=2.0, empty_every=4),
    "bf16": KeptCase(dtype=torch.bfloat16, empty_every=3),
}
# the Triton interpreter is slow: small sets only
TRITON_CASES = ("k1", "k20_neighbours", "mixed_empty_masked", "softcap_scale", "bf16")
PARAMS = [pytest.param(b.values[0], name, marks=b.marks, id=f"{b.id}-{name}") for b in backend_params() for name in CASES
          if b.id != "triton" or name in TRITON_CASES]


@pytest.mark.parametrize("backend,name", PARAMS)
def test_logprobs_match_spec(backend, name):
    check(CASES[name], backend)


@pytest.mark.parametrize("backend", backend_params(triton=False))
def test_many_chunks(backend, monkeypatch):
    """Chunks of a few positions (the chunk loop, grad_weight summed over chunks) give the spec's answer."""
    from grpo_fast.ops import kept

    monkeypatch.setattr(kept, "CHUNK_BYTES", 256)  # a position or two a chunk at H = 16
    check(KeptCase(n=11, empty_every=4), backend)


@pytest.mark.parametrize("backend", backend_params())
def test_empty_sets_are_the_full_vocabulary_bit_for_bit(backend):
    """kept=None, no sets at all, and all-empty sets: one path, the same bits (values and gradients)."""
    case = KeptCase(n=6)
    h, w, b, target, g_logp, g_entropy, _ = make_inputs(case)
    runs = [run_op(h, w, b, target, case, kept, g_logp, g_entropy, backend)
            for kept in (None, KeptSets.none(case.n))]
    for a, c in zip(runs[0][:2] + tuple(runs[0][2]), runs[1][:2] + tuple(runs[1][2]), strict=True):
        assert torch.equal(a, c)


def test_a_whole_vocabulary_set_equals_no_set():
    """A set of every id is the full vocabulary: both routes agree (float32 rounding apart)."""
    case = KeptCase(n=4, vocab=37, k=37)
    h, w, b, target, g_logp, g_entropy, _ = make_inputs(case)
    full = run_op(h, w, b, target, case, None, g_logp, g_entropy, "cpu")
    kept = run_op(h, w, b, target, case, make_sets(case, target), g_logp, g_entropy, "cpu")
    for x, y in zip(full[:2] + tuple(full[2]), kept[:2] + tuple(kept[2]), strict=True):
        assert_close(y, x, atol=scaled(2e-6, x), name="whole-vocabulary set vs none")


# ---------------------------------------------------------------------------------------------
# The fused GRPO loss
# ---------------------------------------------------------------------------------------------

LOSS_CASES = {  # the token-local route (gradients in the forward) and the sequence route (autograd)
    "dapo_entropy_bonus": (LossOptions(temperature=0.7, beta=0.04, entropy_coef=0.2), KeptCase(n=12, empty_every=3)),
    "gspo": (LossOptions(temperature=0.7, importance_sampling_level="sequence", loss_type="grpo"),
             KeptCase(n=12, empty_every=4)),
    "softcap_bf16": (LossOptions(temperature=1.0, logit_softcap=3.0), KeptCase(n=12, empty_every=3, dtype=torch.bfloat16,
                                                                              temperature=1.0, softcap=3.0)),
}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_fused_loss_matches_spec(backend, name):
    if backend == "triton" and name == "gspo":
        pytest.skip("the interpreter's time: the sequence route is the logprobs op, tested above")
    options, case = LOSS_CASES[name]
    B, T = 3, case.n // 3
    h, w, b, target, *_ = make_inputs(case, lead=(B, T))
    kept = make_sets(case, target)
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0  # a row without completion tokens
    advantages = torch.randn(B, generator=g)
    true_logp, _ = objective.token_logprobs(h.double() @ w.double().t() + b.double(), target, case.temperature,
                                            logit_softcap=case.softcap, kept=kept)
    old = true_logp.float() + 0.3 * torch.randn(B, T, generator=g)
    tensors = dict(old_logp=old, ref_logp=old - 0.2 if options.beta else None)

    def run(dtype, fused):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (h, w, b)]
        if fused:
            loss, _ = fused_linear_grpo_loss(leaves[0], leaves[1], target, advantages, mask, bias=leaves[2], kept=kept,
                                             options=dataclasses.replace(options, backend=backend), **tensors)
        else:
            logits = leaves[0] @ leaves[1].t() + leaves[2]
            loss, _ = objective.grpo_loss_reference(logits, target, advantages, mask, options, kept=kept, **tensors)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    got, ref, plain = run(None, True), run(torch.float64, False), run(None, False)
    assert_close(got[0], ref[0], atol=tolerance(case, ref[0], plain[0]), name=f"{backend} loss")
    for what, x, y, z in zip(("hidden", "weight", "bias"), got[1], ref[1], plain[1], strict=True):
        assert_close(x, y, atol=tolerance(case, y, z), name=f"{backend} grad {what}")


# ---------------------------------------------------------------------------------------------
# Bad kept sets: one-line errors
# ---------------------------------------------------------------------------------------------


def _bad(kind):
    case = KeptCase(n=4, vocab=11, k=3)
    h, w, b, target, *_ = make_inputs(case)
    good = make_sets(case, target)
    ids, offsets = good.ids.clone(), good.offsets.clone()
    if kind == "target_outside":
        ids[offsets[2]:offsets[3]] = torch.tensor([i for i in range(11) if i != int(target[2])][:3])
    elif kind == "id_range":
        ids[0] = 11
    elif kind == "duplicate":
        ids[offsets[1] + 1] = ids[offsets[1]]
    elif kind == "offsets_length":
        offsets = offsets[:-1]
    elif kind == "offsets_order":
        offsets[1], offsets[2] = offsets[2].clone(), offsets[1].clone()
    return h, w, target, (KeptSets(ids, offsets) if kind != "not_kept_sets" else (ids, offsets))


@pytest.mark.parametrize("kind,pattern", [
    ("target_outside", r"target id \d+ at position 2 is not in its kept set"),
    ("id_range", r"kept.ids must lie in \[0, 11\).*found 11"),
    ("duplicate", r"position 1 keeps id \d+ twice"),
    ("offsets_length", r"one set per position of target_ids \(4\).*got 4"),
    ("offsets_order", r"offsets must be non-decreasing"),
    ("not_kept_sets", r"kept must be an objective.KeptSets"),
])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bad_kept_sets(kind, pattern, backend):
    h, w, target, kept = _bad(kind)
    with pytest.raises(ValueError, match=pattern):
        fused_linear_logprobs(h, w, target, kept=kept, backend=backend)


def test_spec_refuses_a_target_outside_its_set():
    h, w, target, kept = _bad("target_outside")
    with pytest.raises(ValueError, match="at position 2 is not in its kept set"):
        objective.token_logprobs(h @ w.t(), target, kept=kept)


def test_opcheck_linear_logprobs_with_kept_sets():
    """The registered op with kept_ids / kept_offsets: schema, fake and autograd registrations."""
    case = KeptCase(n=6, empty_every=3, masked=True)
    h, w, b, target, *_, mask = make_inputs(case)
    kept = make_sets(case, target)
    args = (h.requires_grad_(True), w.requires_grad_(True), b, target, mask.float(), kept.ids, kept.offsets, 0.7, 1.0,
            None, "cpu", True)
    # (AOT dispatch with dynamic shapes, 1.5 s more, is opcheck'd without kept sets in test_custom_ops.py)
    torch.library.opcheck(torch.ops.grpo_fast.linear_logprobs, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# linear_topk
# ---------------------------------------------------------------------------------------------


def _tied_inputs(vocab=300, hidden=16, n=7, dtype=torch.float32, seed=0):
    """Random rows with exact ties: duplicated weight rows (equal logits), some at the k-th place."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    for dst, src in ((5, 9), (20, 9), (40, 2), (41, 2), (299, 2), (150, 77)):
        w[dst] = w[src]
    return h.to(dtype), w.to(dtype), torch.randint(0, vocab, (n,), generator=g)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("temperature,softcap,dtype", [(1.0, None, torch.float32), (0.7, 2.0, torch.float32),
                                                       (1.3, None, torch.bfloat16)], ids=["identity", "softcap", "bf16"])
def test_linear_topk_equals_a_sort_of_the_logits(backend, temperature, softcap, dtype, monkeypatch):
    from grpo_fast.ops import row_ops

    monkeypatch.setattr(row_ops, "SLAB_BYTES", 3 * 300 * 4)  # chunks of 3 rows
    monkeypatch.setattr(row_ops, "MIN_ROWS", 1)
    h, w, target = _tied_inputs(dtype=dtype)
    z = objective.LogitMap(temperature, 1.0, softcap)((h @ w.t()).float())  # the op's own logits (its dtype's matmul)
    order = torch.sort(z, dim=-1, descending=True, stable=True)
    for k in (1, 3, 10, 300):
        out = linear_topk(h, w, target, temperature=temperature, logit_softcap=softcap, k=k, backend=backend)
        assert torch.equal(out.ids, order.indices[:, :k]), f"k={k}: ids {out.ids} != {order.indices[:, :k]}"
        assert_close(out.values, order.values[:, :k], atol=scaled(2e-6, order.values), name=f"k={k} values")
        assert torch.equal(out.count_ge, (z >= order.values[:, k - 1:k]).sum(-1))
        assert_close(out.lse, torch.logsumexp(z.double(), -1), atol=scaled(2e-6, out.lse), name="lse")
        assert_close(out.target_logit, z.gather(1, target[:, None]).squeeze(1), atol=scaled(2e-6, z), name="target")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_linear_topk_ties_at_the_kth_place(backend):
    """Rows where more logits equal the k-th than places are left: the lowest ids are kept, and count_ge
    says how many reach the k-th value (vLLM's top-k keeps all of them)."""
    vocab, hidden = 50, 4
    h = torch.zeros(2, hidden)
    h[:, 0] = 1.0
    w = torch.zeros(vocab, hidden)
    w[:, 0] = torch.arange(vocab) % 7  # values 0..6, each 7 or 8 times
    out = linear_topk(h, w, k=10, backend=backend, bias=None)
    ids6 = [i for i in range(vocab) if i % 7 == 6]  # 7 of value 6, then value 5's lowest 3
    ids5 = [i for i in range(vocab) if i % 7 == 5][:3]
    assert out.ids[0].tolist() == ids6 + ids5 and out.ids[1].tolist() == ids6 + ids5
    assert out.count_ge.tolist() == [7 + 7, 7 + 7] and out.target_logit is None


def test_linear_topk_bad_k():
    h, w, _ = _tied_inputs()
    for bad in (0, 301, 2.0):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 300\]"):
            linear_topk(h, w, k=bad, backend="cpu")


@pytest.mark.gpu
def test_linear_topk_gpu():
    """On CUDA (cuBLAS slabs, torch.topk, the GPU's chunk budget): Qwen2.5-0.5B's head in bf16, k = 512."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 896, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(151936, 896, device="cuda", generator=gen) * 0.05).bfloat16()
    w[1000] = w[77]  # a tie
    out = linear_topk(h, w, k=512, temperature=0.7, backend="auto")
    z = objective.LogitMap(0.7)((h @ w.t()).float())
    order = torch.sort(z, dim=-1, descending=True, stable=True)
    assert torch.equal(out.ids, order.indices[:, :512])
    assert_close(out.lse, torch.logsumexp(z, -1), atol=scaled(2e-6, out.lse), name="lse")

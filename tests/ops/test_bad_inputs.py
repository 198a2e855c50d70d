"""Bad input gets a clear error before any work: it names the argument, what was expected and
what was given."""

from __future__ import annotations

import pytest
import torch

from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs

B, T, H, V = 2, 3, 8, 11


def _good():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        target_ids=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, generator=g),
        mask=torch.ones(B, T),
    )


def _loss(backend="cpu", **changes):
    args = {**_good(), **changes}
    pos = [args.pop(k) for k in ("hidden", "weight", "target_ids", "advantages", "mask")]
    return fused_linear_grpo_loss(*pos, backend=backend, **args)


def _logprobs(backend="cpu", **changes):
    args = {**_good(), **changes}
    return fused_linear_logprobs(args["hidden"], args["weight"], args["target_ids"], backend=backend,
                                 **{k: v for k, v in changes.items() if k in ("bias", "temperature")})


@pytest.mark.parametrize("op", [_loss, _logprobs], ids=["loss", "logprobs"])
@pytest.mark.parametrize("bad", [V, -1])
def test_target_out_of_range(op, bad):
    target = torch.zeros(B, T, dtype=torch.int64)
    target[1, 2] = bad
    with pytest.raises(ValueError, match=rf"target_ids must lie in \[0, {V}\).*found {bad}"):
        op(target_ids=target)


@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(target_ids=torch.zeros(B, T + 1, dtype=torch.int64)), r"target_ids must have shape \[2, 3\].*got \[2, 4\]"),
        (dict(weight=torch.randn(V, H + 1)), r"disagree on H: hidden \[2, 3, 8\], weight \[11, 9\]"),
        (dict(mask=torch.ones(B, T + 1)), r"mask must have shape \[2, 3\].*got \[2, 4\]"),
        (dict(advantages=torch.randn(B + 1)), r"advantages must have shape \[2\] or \[2, 3\], got \[3\]"),
        (dict(old_logp=torch.randn(B, T - 1)), r"old_logp must have shape \[2, 3\].*got \[2, 2\]"),
        (dict(ref_logp=torch.randn(B), beta=0.1), r"ref_logp must have shape \[2, 3\].*got \[2\]"),
        (dict(is_weights=torch.randn(T, B)), r"is_weights must have shape \[2, 3\].*got \[3, 2\]"),
        (dict(bias=torch.randn(V + 1)), r"bias must be \[11\].*got \[12\]"),
        (dict(hidden=torch.randn(B * T, H), target_ids=torch.zeros(B * T, dtype=torch.int64)), r"hidden must be \[B, T, H\], got shape \[6, 8\]"),
    ],
    ids=["target", "weight_H", "mask", "advantages", "old_logp", "ref_logp", "is_weights", "bias", "hidden_2d"],
)
def test_shape_mismatch_names_argument_and_shapes(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        _loss(**changes)


@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(weight=torch.randn(V, H).bfloat16()), r"hidden and weight must share one floating dtype, got hidden torch.float32, weight torch.bfloat16"),
        (dict(target_ids=torch.zeros(B, T)), r"target_ids must be an integer tensor, got dtype torch.float32"),
        (dict(bias=torch.randn(V, dtype=torch.float64)), r"bias must be \[11\] of dtype torch.float32, got \[11\] torch.float64"),
    ],
    ids=["hidden_vs_weight", "float_target", "bias"],
)
def test_dtype_mismatch(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        _loss(**changes)
    with pytest.raises(ValueError, match=pattern):
        _logprobs(**changes)


def test_non_contiguous_weight():
    weight = torch.randn(H, V).t()  # [V, H] view with strides (1, V)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[V, H\] \(got strides \(1, 11\)\); pass weight.contiguous\(\)"):
        _loss(weight=weight)


@pytest.mark.parametrize("op", [_loss, _logprobs], ids=["loss", "logprobs"])
def test_unknown_backend(op):
    with pytest.raises(ValueError, match=r"backend='cuda' is unknown; expected one of \['auto', 'triton', 'cpu', 'torch'\]"):
        op(backend="cuda")


def test_unknown_loss_type():
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not supported; expected one of \['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', "
                                         r"'sapo', 'vespo', 'luspo'\]"):
        _loss(loss_type="ppo")


def test_bad_options():
    with pytest.raises(ValueError, match=r"beta=0.1 needs ref_logp"):
        _loss(beta=0.1)
    with pytest.raises(ValueError, match=r"importance_sampling_level='seq' is not supported"):
        _loss(importance_sampling_level="seq")
    with pytest.raises(ValueError, match=r"temperature must be a positive finite number, got 0"):
        _loss(temperature=0)
    with pytest.raises(ValueError, match=r"delta must be > 1"):
        _loss(delta=0.5)


@pytest.mark.parametrize("op", [_loss, _logprobs], ids=["loss", "logprobs"])
def test_triton_on_cpu_without_interpreter(op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, got tensors on cpu.*TRITON_INTERPRET=1"):
        op(backend="triton")

"""The fused ops as registered custom ops (`torch.ops.grpo_fast.*`).

`torch.library.opcheck` checks each op's schema (no hidden mutation or aliasing), its fake (meta)
implementation against the real one, its autograd registration and its behaviour under AOT
autograd with dynamic shapes. Then `torch.compile(fullgraph=True)` of a user function calling the
public ops must trace in one graph and give eager's loss and gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_fast.objective import LossOptions
from grpo_fast.ops import fused_linear_grpo_loss, fused_linear_logprobs, masked_linear_logprobs
from grpo_fast.ops.grpo_loss import OPTION_NAMES
from tests.helpers import assert_close, scaled
from tests.ops.cases import backend_params

B, T, H, V = 2, 5, 8, 13


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden=torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True),
        weight=(torch.randn(V, H, generator=g) * H**-0.5 * 2).to(dtype).requires_grad_(True),
        bias=(torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_(True),
        target_ids=torch.randint(0, V, (B, T), generator=g),
        mask=(torch.rand(B, T, generator=g) > 0.3).float(),
        advantages=torch.randn(B, generator=g),
        old_logp=-torch.rand(B, T, generator=g) * 3,
        ref_logp=-torch.rand(B, T, generator=g) * 3,
        is_weights=torch.rand(B, T, generator=g) + 0.5,
        entropy_weights=torch.rand(B, T, generator=g) / (B * T),
    )


def _option_values(options: LossOptions) -> list:
    return [getattr(options, name) for name in OPTION_NAMES]


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------

LOSS_VARIANTS = {  # name: (loss options, which inputs are left out, needs)
    "all": (LossOptions(beta=0.04, epsilon_high=0.28, delta=1.5, temperature=0.7), (), [True, True, True]),
    "grpo-no-bias": (LossOptions(loss_type="grpo", max_completion_length=9), ("bias", "ref_logp"), [True, True, False]),
    "hidden-only-no-old": (LossOptions(loss_type="dr_grpo"), ("old_logp", "is_weights"), [True, False, False]),
    "no-grads": (LossOptions(), (), [False, False, False]),
    "cispo-entropy-bonus": (LossOptions(loss_type="cispo", epsilon_high=5.0, entropy_coef=0.1), (), [True, True, True]),
    "sapo-default-entropy-weights": (LossOptions(loss_type="sapo", entropy_coef=-0.05), ("entropy_weights",),
                                     [True, True, True]),
}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_opcheck_fused_linear_grpo_loss(backend, variant):
    options, left_out, needs = LOSS_VARIANTS[variant]
    x = {k: None if k in left_out else v for k, v in _inputs().items()}
    num_items = torch.tensor(7.0) if options.loss_type == "dapo" else None
    args = (x["hidden"], x["weight"], x["bias"], x["target_ids"], x["advantages"], x["mask"], x["old_logp"],
            x["ref_logp"], x["is_weights"], x["entropy_weights"], num_items, None, None, needs, False,
            *_option_values(dataclasses.replace(options, backend=backend)))
    torch.library.opcheck(torch.ops.grpo_fast.fused_linear_grpo_loss, args)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("masked,bias,entropy_grad", [(True, True, True), (False, False, False)],
                         ids=["masked-bias-entropy_grad", "plain"])
def test_opcheck_linear_logprobs(backend, masked, bias, entropy_grad):
    x = _inputs()
    logit_map = (0.7, 1.5, 3.0) if masked else (0.7, 1.0, None)  # (temperature, logit_scale, logit_softcap)
    args = (x["hidden"], x["weight"], x["bias"] if bias else None, x["target_ids"], x["mask"] if masked else None,
            None, None, *logit_map, backend, entropy_grad)
    torch.library.opcheck(torch.ops.grpo_fast.linear_logprobs, args)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("needs", [[True, True, True], [False, True, False]], ids=["all", "weight"])
def test_opcheck_linear_logprobs_backward(backend, needs):
    x = {k: v.detach() if v.is_floating_point() else v for k, v in _inputs().items()}
    _, entropy, lse = torch.ops.grpo_fast.linear_logprobs(x["hidden"], x["weight"], x["bias"], x["target_ids"],
                                                           x["mask"], None, None, 0.7, 1.5, 3.0, backend, True)
    grad_logp = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    grad_entropy = torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    args = (x["hidden"], x["weight"], x["bias"], x["target_ids"], x["mask"], None, None, lse, grad_logp, 0.7, 1.5, 3.0,
            backend, needs, entropy, grad_entropy)
    torch.library.opcheck(torch.ops.grpo_fast.linear_logprobs_backward, args)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


def _user_step(level: str):
    """A user function over both public ops (and the masked one): loss, a log-prob term, a metric."""

    def step(hidden, weight, bias, target_ids, mask, advantages, old_logp, ref_logp):
        loss, metrics = fused_linear_grpo_loss(
            hidden, weight, target_ids, advantages, mask, old_logp=old_logp, ref_logp=ref_logp, bias=bias,
            beta=0.04, epsilon_high=0.28, temperature=0.7, importance_sampling_level=level, num_items_in_batch=7,
            backend="cpu",
        )
        logp = fused_linear_logprobs(hidden, weight, target_ids, bias=bias, temperature=0.7, backend="cpu")
        logp_masked, entropy = masked_linear_logprobs(hidden, weight, target_ids, mask, bias=bias, temperature=0.7,
                                                      backend="torch", return_entropy=True, fill=old_logp)
        return loss + 0.1 * (logp * mask).sum() + 0.05 * logp_masked.sum() + metrics["kl"] + 0 * entropy.sum()

    return step


def _run(fn, x):
    leaves = [x[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    out = fn(*leaves, *(x[k] for k in ("target_ids", "mask", "advantages", "old_logp", "ref_logp")))
    out.backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _check_compiled(backend: str, level: str, exact: bool):
    torch._dynamo.reset()
    x = _inputs()
    step = _user_step(level)
    loss, grads = _run(step, x)
    compiled_loss, compiled_grads = _run(torch.compile(step, fullgraph=True, backend=backend), x)
    tol = lambda expected: 0.0 if exact else scaled(1e-6, expected)  # inductor may fuse the user's sums differently
    assert_close(compiled_loss, loss, atol=tol(loss), name=f"{backend} {level} loss")
    for name, got, expected in zip(("hidden", "weight", "bias"), compiled_grads, grads, strict=True):
        assert_close(got, expected, atol=tol(expected), name=f"{backend} {level} grad {name}")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compile_fullgraph_aot_eager_matches_eager(level):
    _check_compiled("aot_eager", level, exact=True)


@pytest.mark.slow
def test_compile_fullgraph_inductor_matches_eager():
    _check_compiled("inductor", "token", exact=False)


# ---------------------------------------------------------------------------------------------
# The loss op's gradients: computed in forward, scaled in place in backward
# ---------------------------------------------------------------------------------------------


def test_eager_backward_scales_the_forward_gradients_in_place():
    """No second [V, H] buffer: with private_grads (what fused_linear_grpo_loss passes), the gradient
    the op returned is the one backward scales and hands to autograd."""
    x = _inputs()
    options = LossOptions(temperature=0.7, backend="cpu")
    loss, _, grad_hidden, grad_weight, grad_bias = torch.ops.grpo_fast.fused_linear_grpo_loss(
        x["hidden"], x["weight"], x["bias"], x["target_ids"], x["advantages"], x["mask"], x["old_logp"], None, None, None,
        None, None, None, [True, True, True], True, *_option_values(options))
    unscaled = grad_weight.clone()
    (loss * -2.5).backward()
    assert_close(grad_weight, unscaled * -2.5, atol=0.0, name="the forward's grad_weight, scaled")
    assert_close(x["weight"].grad, grad_weight, atol=0.0, name="weight.grad")


def test_backward_twice_is_refused():
    x = _inputs()
    loss, _ = fused_linear_grpo_loss(x["hidden"], x["weight"], x["target_ids"], x["advantages"], x["mask"],
                                     backend="cpu")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# The keyword front and the options object
# ---------------------------------------------------------------------------------------------


def test_keywords_and_options_object_agree():
    x = _inputs()
    keywords = dict(beta=0.04, epsilon_low=0.1, epsilon_high=0.28, delta=1.5, temperature=0.7, loss_type="dr_grpo",
                    importance_sampling_level="token", max_completion_length=9, backend="torch")
    tensors = dict(old_logp=x["old_logp"], ref_logp=x["ref_logp"], is_weights=x["is_weights"])
    args = (x["target_ids"], x["advantages"], x["mask"])
    loss_k, metrics_k = fused_linear_grpo_loss(x["hidden"], x["weight"], *args, bias=x["bias"], **tensors, **keywords)
    loss_o, metrics_o = fused_linear_grpo_loss(x["hidden"], x["weight"], *args, bias=x["bias"], **tensors,
                                               options=LossOptions(**keywords))
    assert torch.equal(loss_k, loss_o)
    assert all(torch.equal(metrics_k[name], metrics_o[name]) for name in metrics_k)


def test_options_object_and_keywords_together_refused():
    x = _inputs()
    with pytest.raises(ValueError, match=r"either as options=LossOptions\(...\) or as keywords, not both"):
        fused_linear_grpo_loss(x["hidden"], x["weight"], x["target_ids"], x["advantages"], x["mask"], beta=0.1,
                               ref_logp=x["ref_logp"], options=LossOptions(beta=0.1))


@pytest.mark.parametrize("backend", backend_params(triton=False))
def test_weight_grad_is_the_buffer_the_forward_filled(backend, monkeypatch):
    """Peak memory as before registration: backward scales the forward's [V, H] gradient in place
    and autograd takes that very buffer as weight.grad (no copy, no second buffer)."""
    from grpo_fast.ops import chunk_driver

    filled = []
    result = chunk_driver.ParamGrads.result
    monkeypatch.setattr(chunk_driver.ParamGrads, "result", lambda self: filled.append(self.grad_weight) or result(self))
    x = _inputs()
    loss, _ = fused_linear_grpo_loss(x["hidden"], x["weight"], x["target_ids"], x["advantages"], x["mask"],
                                     old_logp=x["old_logp"], bias=x["bias"], backend=backend)
    pointer = filled[0].data_ptr()
    filled.clear()  # the test's own reference would make autograd copy
    (loss * 3).backward()
    assert x["weight"].grad.data_ptr() == pointer

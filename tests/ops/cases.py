"""Inputs and references for the fused-op tests (tests/ops/test_fused_ops.py and friends).

The reference is the specification itself, `objective.grpo_loss_reference`, applied to logits the
test computes in float64 from the very same (possibly bf16-rounded) inputs, with gradients by
autograd back to float64 copies of hidden, weight and bias. "Plain PyTorch in the input dtype" is
the same reference fed logits computed by a matmul in that dtype: the error it makes is the yardstick
for the bf16 tolerances.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from grpo_fast import objective
from grpo_fast.objective import LossOptions

BACKENDS_UNDER_TEST = ["torch", "cpu", "triton"]

# the cases' default loss options: a temperature other than 1 exercises the scaling everywhere
CASE_OPTIONS = LossOptions(temperature=0.7)


def loss_options(**changes) -> LossOptions:
    """CASE_OPTIONS with `changes` (the loss options of one case)."""
    return dataclasses.replace(CASE_OPTIONS, **changes)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec("grpo_fast.kernels.linear_logprobs") is not None


def backend_params(triton: bool = True):
    """pytest params for BACKENDS_UNDER_TEST; 'triton' is skipped, with the reason, where its module is missing
    (never xfail: that would turn a third of the backend matrix silently green)."""
    params = []
    for name in BACKENDS_UNDER_TEST:
        if name == "triton":
            if not triton:
                continue
            marks = [] if triton_available() else [pytest.mark.skip(reason="grpo_fast.kernels.linear_logprobs not importable: triton is missing")]
            params.append(pytest.param(name, marks=marks, id=name))
        else:
            params.append(pytest.param(name, id=name))
    return params


@dataclass
class Case:
    """One loss configuration. `mask`: "random", "full", "empty_row" (one sequence with no
    completion tokens), "none" (all-masked batch) or "one" (a single active token)."""

    B: int = 3
    T: int = 5
    H: int = 16
    V: int = 37
    dtype: torch.dtype = torch.float32
    bias: bool = False
    mask: str = "random"
    adv_per_token: bool = False
    old_logp: bool = True
    ref_logp: bool = False
    is_weights: bool = False
    is_ratio: bool = False  # vespo's vLLM importance ratio
    entropy_weights: bool = False  # explicit entropy-bonus weights (else the spec's default)
    options: LossOptions = CASE_OPTIONS  # the backend is the test's
    num_items_in_batch: Optional[float] = None
    seed: int = 0
    device: str = "cpu"

    def __str__(self):
        parts = [f"B{self.B}T{self.T}H{self.H}V{self.V}", str(self.dtype).replace("torch.", ""), self.mask]
        parts += [n for n in ("bias", "adv_per_token", "ref_logp", "is_weights", "is_ratio", "entropy_weights")
                  if getattr(self, n)]
        parts += [] if self.old_logp else ["no_old"]
        parts += [f"{f.name}={getattr(self.options, f.name)}" for f in dataclasses.fields(LossOptions)
                  if getattr(self.options, f.name) != getattr(CASE_OPTIONS, f.name)]
        parts += [] if self.num_items_in_batch is None else [f"num_items_in_batch={self.num_items_in_batch}"]
        return "-".join(parts)


def make_inputs(case: Case) -> dict:
    """Seeded tensors for `case`; old/ref log-probs are the true ones plus noise, so ratios spread
    around 1 and both clip sides, the delta cap and the KL term are exercised."""
    g = torch.Generator().manual_seed(case.seed)
    B, T, H, V = case.B, case.T, case.H, case.V
    hidden = torch.randn(B, T, H, generator=g).to(case.dtype)
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(case.dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(case.dtype) if case.bias else None
    target = torch.randint(0, V, (B, T), generator=g)
    mask = {
        "random": (torch.rand(B, T, generator=g) > 0.3),
        "full": torch.ones(B, T, dtype=torch.bool),
        "none": torch.zeros(B, T, dtype=torch.bool),
    }.get(case.mask)
    if case.mask == "empty_row":
        mask = torch.rand(B, T, generator=g) > 0.2
        mask[0] = False
    if case.mask == "one":
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[-1, -1] = True
    advantages = torch.randn(B, T, generator=g) if case.adv_per_token else torch.randn(B, generator=g)
    true_logp, _ = objective.token_logprobs(logits64(hidden, weight, bias), target, case.options.temperature,
                                            logit_scale=case.options.logit_scale,
                                            logit_softcap=case.options.logit_softcap)
    inputs = dict(hidden=hidden, weight=weight, bias=bias, target_ids=target, advantages=advantages, mask=mask.float())
    if case.old_logp:
        inputs["old_logp"] = true_logp + 0.3 * torch.randn(B, T, generator=g)
    if case.ref_logp:
        inputs["ref_logp"] = true_logp + 0.5 * torch.randn(B, T, generator=g)
    if case.is_weights:
        inputs["is_weights"] = torch.rand(B, T, generator=g) * 1.5 + 0.25
    if case.is_ratio:
        inputs["is_ratio"] = torch.rand(B, T, generator=g) * 1.5 + 0.25
    if case.entropy_weights:  # a high-entropy-token mask over a normaliser, as a trainer passes them
        inputs["entropy_weights"] = (torch.rand(B, T, generator=g) > 0.5).float() * mask.float() / 7.0
    return {k: None if v is None else v.to(case.device) for k, v in inputs.items()}


def logits64(hidden, weight, bias):
    out = hidden.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


def _leaves(inputs, dtype):
    """Fresh leaf copies of (hidden, weight, bias) in `dtype` (None keeps the input dtype)."""
    return [None if t is None else (t if dtype is None else t.to(dtype)).detach().clone().requires_grad_(True)
            for t in (inputs["hidden"], inputs["weight"], inputs["bias"])]


def _extras(inputs):
    return {k: inputs[k] for k in ("old_logp", "ref_logp", "is_weights", "is_ratio", "entropy_weights") if k in inputs}


def run_reference(case: Case, inputs: dict, grad_scale: float = 3.0, plain: bool = False):
    """(loss, metrics, grads) of the spec. plain=False: logits in float64 (the exact reference);
    plain=True: logits by a matmul in the input dtype, as plain PyTorch would do it."""
    h, w, b = _leaves(inputs, None if plain else torch.float64)
    logits = h @ w.t() if b is None else h @ w.t() + b
    loss, metrics = objective.grpo_loss_reference(
        logits, inputs["target_ids"], inputs["advantages"], inputs["mask"], case.options,
        num_items_in_batch=case.num_items_in_batch, **_extras(inputs),
    )
    (loss * grad_scale).backward()
    return loss.detach(), metrics, [None if t is None else t.grad for t in (h, w, b)]


def run_fused(case: Case, inputs: dict, backend: str, grad_scale: float = 3.0):
    from grpo_fast.ops import fused_linear_grpo_loss

    h, w, b = _leaves(inputs, None)
    loss, metrics = fused_linear_grpo_loss(
        h, w, inputs["target_ids"], inputs["advantages"], inputs["mask"], bias=b,
        options=dataclasses.replace(case.options, backend=backend), num_items_in_batch=case.num_items_in_batch,
        **_extras(inputs),
    )
    (loss * grad_scale).backward()
    return loss.detach(), metrics, [None if t is None else t.grad for t in (h, w, b)]

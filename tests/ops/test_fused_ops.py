"""Every backend of the fused ops equals the specification (`objective.grpo_loss_reference`).

Loss, every metric and the gradients w.r.t. hidden, weight and bias, for all loss types and
options, against the spec on float64 logits of the same inputs (see tests/ops/cases.py).

Tolerances. Every quantity is allowed `4 x` the error plain PyTorch makes in the input dtype
(the spec fed logits from a matmul in that dtype; that error is measured in the same test) plus
a floor of 2e-6 (float32) or 1e-3 (bfloat16, a quarter of its ulp) times (1 + max |expected|).
Measured on these shapes, max abs against the float64-logit spec: float32, plain 0-6e-8 on the
loss and 2e-7 to 5e-7 on gradients (values of order 1), the backends 3e-8 and 2e-7 to 1.2e-6;
bfloat16, plain 3e-4 to 3e-3 on the loss and 4e-3 to 1.1e-2 on gradients, the backends 1e-3 to
3e-3 and 4e-3 to 1.9e-2. A 1e-4 relative error in the row-gradient scale fails the float32 cases.
"""

from __future__ import annotations

import pytest
import torch

from grpo_fast import objective
from tests.helpers import assert_close, plain_bound
from tests.ops.cases import Case, backend_params, loss_options, make_inputs, run_fused, run_reference

FACTOR = 4.0  # x the plain-PyTorch error in the same dtype
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-3}  # x (1 + largest |expected|); bf16: 1/4 of its ulp


def _bound(expected, plain, dtype):
    return plain_bound(expected, plain, factor=FACTOR, floor=FLOOR[dtype])


def _check_against_spec(case: Case, backend: str):
    inputs = make_inputs(case)
    loss, metrics, grads = run_fused(case, inputs, backend)
    ref_loss, ref_metrics, ref_grads = run_reference(case, inputs)
    plain_loss, plain_metrics, plain_grads = run_reference(case, inputs, plain=True)

    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, ref_loss, atol=_bound(ref_loss, plain_loss, case.dtype), name=f"{backend} loss")
    n_active = max(int(inputs["mask"].sum()), 1)
    assert set(metrics) == set(ref_metrics) == set(objective.metric_names(case.options))
    for name in metrics:
        if name.startswith(("clip_ratio", "cispo_clip_ratio")) and case.dtype != torch.float32:
            atol = 1.0 / n_active + 1e-6  # a bf16 ratio right at the clip edge may flip one token
        else:
            atol = _bound(ref_metrics[name], plain_metrics[name], case.dtype)
        assert_close(metrics[name], ref_metrics[name], atol=atol, name=f"{backend} metric {name}")
    for what, got, ref, plain in zip(("hidden", "weight", "bias"), grads, ref_grads, plain_grads, strict=True):
        if ref is None:
            assert got is None, f"{backend}: unexpected gradient for {what}"
            continue
        assert got is not None and got.dtype == case.dtype and got.shape == ref.shape, (what, got)
        assert_close(got, ref, atol=_bound(ref, plain, case.dtype), name=f"{backend} grad {what}")


LOSS_TYPES_AND_LEVELS = [(lt, lvl) for lt in objective.LOSS_TYPES for lvl in objective.IMPORTANCE_SAMPLING_LEVELS]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("loss_type,level", LOSS_TYPES_AND_LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_types_levels_beta(backend, loss_type, level, beta):
    case = Case(ref_logp=beta > 0 or loss_type == "bnpo", bias=loss_type in ("grpo", "dapo"),
                options=loss_options(loss_type=loss_type, importance_sampling_level=level, beta=beta))
    _check_against_spec(case, backend)


OPTION_CASES = {
    "eps_high": Case(options=loss_options(epsilon_high=0.28)),
    "delta": Case(options=loss_options(delta=1.5, epsilon_high=0.28)),
    "delta_seq": Case(options=loss_options(delta=1.5, importance_sampling_level="sequence")),
    "is_weights": Case(is_weights=True, ref_logp=True, options=loss_options(beta=0.04)),
    "adv_per_token": Case(adv_per_token=True, options=loss_options(loss_type="grpo")),
    "adv_per_token_seq": Case(adv_per_token=True, options=loss_options(importance_sampling_level="sequence")),
    "no_old_logp": Case(old_logp=False, ref_logp=True, options=loss_options(beta=0.04)),
    "no_old_logp_seq": Case(old_logp=False, options=loss_options(importance_sampling_level="sequence", loss_type="grpo")),
    "empty_row": Case(mask="empty_row", options=loss_options(loss_type="grpo")),
    "empty_row_seq": Case(mask="empty_row", options=loss_options(importance_sampling_level="sequence")),
    "all_masked": Case(mask="none", options=loss_options(loss_type="grpo")),
    "all_masked_seq": Case(mask="none", options=loss_options(importance_sampling_level="sequence")),
    "one_token": Case(B=1, T=1, mask="full"),
    "one_active_token": Case(mask="one", options=loss_options(loss_type="bnpo")),
    "V5": Case(V=5, bias=True),
    "V131": Case(V=131, T=3, options=loss_options(epsilon_high=0.28)),
    "num_items": Case(options=loss_options(loss_type="dapo"), num_items_in_batch=40),
    "max_len": Case(options=loss_options(loss_type="dr_grpo", max_completion_length=9)),
    "temperature_1": Case(ref_logp=True, options=loss_options(temperature=1.0, beta=0.04)),
    "bf16": Case(dtype=torch.bfloat16, bias=True, ref_logp=True, options=loss_options(beta=0.04, epsilon_high=0.28)),
    "bf16_seq": Case(dtype=torch.bfloat16, V=131, options=loss_options(importance_sampling_level="sequence")),
    "bf16_grpo": Case(dtype=torch.bfloat16, is_weights=True, adv_per_token=True, options=loss_options(loss_type="grpo")),
    # TRL's loss types beyond the clipped surrogate (off-policy old log-probs in every case: at ratio 1
    # sapo has grpo's gradient and vespo dapo's)
    "cispo_eps5": Case(ref_logp=True, options=loss_options(loss_type="cispo", epsilon_high=5.0, beta=0.04)),
    "cispo_wide_ratio": Case(options=loss_options(loss_type="cispo", epsilon_high=1.1)),
    "sapo_adv_per_token": Case(adv_per_token=True, is_weights=True, options=loss_options(loss_type="sapo")),
    "sapo_temperatures": Case(options=loss_options(loss_type="sapo", sapo_temperature_pos=0.5,
                                                   sapo_temperature_neg=2.0)),
    "vespo_is_ratio": Case(is_ratio=True, is_weights=True, options=loss_options(loss_type="vespo")),
    "vespo_k_lambda": Case(B=4, options=loss_options(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.5,
                                                     vespo_k_neg=2.5, vespo_lambda_neg=1.0)),
    "vespo_empty_row": Case(mask="empty_row", options=loss_options(loss_type="vespo")),
    "luspo_seq_delta": Case(options=loss_options(loss_type="luspo", importance_sampling_level="sequence", delta=1.5)),
    "bias_corrected_kl": Case(ref_logp=True, options=loss_options(beta=0.04, use_bias_correction_kl=True, delta=1.3)),
    "bias_corrected_kl_seq": Case(ref_logp=True, options=loss_options(
        loss_type="grpo", beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence")),
    "bf16_cispo_sapo": Case(dtype=torch.bfloat16, bias=True, options=loss_options(loss_type="sapo")),
    "bf16_vespo": Case(dtype=torch.bfloat16, V=131, options=loss_options(loss_type="vespo")),
    # the entropy bonus: its gradient from the same pass as the log-probs'
    "entropy_bonus": Case(bias=True, ref_logp=True, options=loss_options(entropy_coef=0.3, beta=0.04)),
    "entropy_bonus_weights": Case(entropy_weights=True, options=loss_options(loss_type="grpo", entropy_coef=-0.2)),
    "entropy_bonus_only": Case(old_logp=False, options=loss_options(entropy_coef=0.5, epsilon_low=0.0,
                                                                    epsilon_high=0.0)),
    "entropy_bonus_seq": Case(bias=True, options=loss_options(importance_sampling_level="sequence", loss_type="grpo",
                                                              entropy_coef=0.3)),
    "entropy_bonus_vespo": Case(entropy_weights=True, options=loss_options(loss_type="vespo", entropy_coef=0.3)),
    # the model's logit map inside the op (objective.LogitMap): Gemma 2's soft-cap (small here, so the
    # logits bend) with a scale, on the fused route and the sequence route, in bf16; Cohere's scale alone
    "softcap": Case(bias=True, ref_logp=True, options=loss_options(logit_scale=1.5, logit_softcap=3.0, beta=0.04,
                                                                   entropy_coef=0.2)),
    "softcap_seq": Case(options=loss_options(logit_softcap=2.0, importance_sampling_level="sequence")),
    "bf16_softcap": Case(dtype=torch.bfloat16, V=131, options=loss_options(logit_softcap=3.0, epsilon_high=0.28)),
    "logit_scale": Case(options=loss_options(logit_scale=0.25, loss_type="grpo")),
    "entropy_bonus_empty_row": Case(mask="empty_row", options=loss_options(loss_type="cispo", entropy_coef=0.3)),
    "entropy_bonus_all_masked": Case(mask="none", options=loss_options(entropy_coef=0.3)),
    "entropy_bonus_V131": Case(V=131, T=3, bias=True, options=loss_options(loss_type="sapo", entropy_coef=0.3)),
    "entropy_bonus_temperature_1": Case(options=loss_options(temperature=1.0, entropy_coef=0.3)),
    "bf16_entropy_bonus": Case(dtype=torch.bfloat16, bias=True, options=loss_options(entropy_coef=0.3)),
    "bf16_entropy_bonus_seq": Case(dtype=torch.bfloat16, V=131, options=loss_options(
        importance_sampling_level="sequence", entropy_coef=0.3)),
}


# The Triton interpreter takes 0.1-0.8 s per case at these shapes: every case runs on it too.
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_options(backend, name):
    _check_against_spec(OPTION_CASES[name], backend)


@pytest.mark.parametrize("backend", backend_params())
def test_upstream_gradient_is_applied(backend):
    """loss * 3 vs loss * -0.5: the fused route computes gradients in forward and scales them in
    backward; both scales must come out right (and not accumulate across calls)."""
    case = Case(V=37, T=4, ref_logp=True, options=loss_options(beta=0.04))
    inputs = make_inputs(case)
    for scale in (3.0, -0.5):
        _, _, grads = run_fused(case, inputs, backend, grad_scale=scale)
        _, _, ref = run_reference(case, inputs, grad_scale=scale)
        _, _, plain = run_reference(case, inputs, grad_scale=scale, plain=True)
        for what, got, exp, pl in zip(("hidden", "weight"), grads[:2], ref[:2], plain[:2], strict=True):
            assert_close(got, exp, atol=_bound(exp, pl, case.dtype), name=f"{backend} grad {what} at scale {scale}")


@pytest.mark.parametrize("backend", backend_params(triton=False))
def test_no_grad_inputs(backend):
    """Inputs that do not require grad: the op still returns the spec's loss (forward only)."""
    from grpo_fast.ops import fused_linear_grpo_loss

    case = Case()
    inputs = make_inputs(case)
    loss, metrics = fused_linear_grpo_loss(
        inputs["hidden"], inputs["weight"], inputs["target_ids"], inputs["advantages"], inputs["mask"],
        old_logp=inputs["old_logp"], temperature=case.options.temperature, backend=backend,
    )
    ref_loss, _, _ = run_reference(case, inputs)
    plain_loss, _, _ = run_reference(case, inputs, plain=True)
    assert not loss.requires_grad
    assert_close(loss, ref_loss, atol=_bound(ref_loss, plain_loss, case.dtype), name="loss")


@pytest.mark.parametrize("backend", backend_params(triton=False))
@pytest.mark.parametrize("name", ["is_weights", "bf16", "bf16_seq", "empty_row_seq", "entropy_bonus",
                                  "bf16_entropy_bonus", "entropy_bonus_seq", "vespo_is_ratio"])
def test_many_chunks(backend, name, monkeypatch):
    """A slab of 3 rows: the chunk loop (slab reuse, ragged last chunk, grad_weight summed over
    chunks, in bf16 too) gives the spec's answer."""
    from grpo_fast.ops import row_ops

    case = OPTION_CASES[name]
    monkeypatch.setattr(row_ops, "SLAB_BYTES", 3 * case.V * torch.finfo(case.dtype).bits // 8)
    monkeypatch.setattr(row_ops, "MIN_ROWS", 1)
    assert row_ops.chunk_rows(case.B * case.T, case.V, itemsize=torch.finfo(case.dtype).bits // 8) == 3
    _check_against_spec(case, backend)

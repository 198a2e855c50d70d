"""GPU twins of tests/ops/test_fused_ops.py: backend auto (= triton) and torch on CUDA tensors, at
shapes where the kernels run many vocab tiles and token blocks, against the spec on float64
logits, with the same tolerance rule (4 x plain PyTorch's error in the dtype + a floor)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ops.cases import Case, loss_options
from tests.ops.test_fused_ops import _check_against_spec

pytestmark = pytest.mark.gpu

BASE = Case(B=4, T=96, H=256, V=4099, device="cuda")
GPU_CASES = {
    "fp32_token": dataclasses.replace(BASE, bias=True, ref_logp=True, options=loss_options(beta=0.04, epsilon_high=0.28, delta=1.5)),
    "fp32_seq": dataclasses.replace(BASE, mask="empty_row", options=loss_options(importance_sampling_level="sequence", loss_type="grpo")),
    "bf16_token": dataclasses.replace(BASE, dtype=torch.bfloat16, is_weights=True, adv_per_token=True, options=loss_options(loss_type="bnpo")),
    "bf16_seq": dataclasses.replace(BASE, dtype=torch.bfloat16, old_logp=False, options=loss_options(importance_sampling_level="sequence")),
    "bf16_big_vocab": dataclasses.replace(BASE, B=2, T=64, H=128, V=151936, dtype=torch.bfloat16,
                                       options=loss_options(temperature=1.0)),
    # TRL's loss types and the entropy bonus (its gradient from the fused kernels' pass)
    "fp32_cispo_entropy": dataclasses.replace(BASE, bias=True, options=loss_options(loss_type="cispo", epsilon_high=1.2,
                                                                                      entropy_coef=0.3)),
    "bf16_sapo_entropy": dataclasses.replace(BASE, dtype=torch.bfloat16, ref_logp=True, options=loss_options(
        loss_type="sapo", beta=0.04, use_bias_correction_kl=True, entropy_coef=0.3)),
    "bf16_vespo_entropy": dataclasses.replace(BASE, dtype=torch.bfloat16, mask="empty_row", is_ratio=True,
                                              options=loss_options(loss_type="vespo", entropy_coef=0.3)),
    "bf16_luspo_seq": dataclasses.replace(BASE, dtype=torch.bfloat16, options=loss_options(
        loss_type="luspo", importance_sampling_level="sequence")),
    "bf16_big_vocab_entropy": dataclasses.replace(BASE, B=2, T=64, H=128, V=151936, dtype=torch.bfloat16,
                                               options=loss_options(temperature=1.0, entropy_coef=0.3)),
}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_against_spec(backend, name):
    _check_against_spec(GPU_CASES[name], backend)

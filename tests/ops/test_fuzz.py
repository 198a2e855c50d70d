"""Property-based fuzzing of shapes and options: every backend equals the spec (few, small
examples; the Triton interpreter gets fewer)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_fast import objective
from tests.ops.cases import Case, backend_params, loss_options
from tests.ops.test_fused_ops import _check_against_spec

EXAMPLES = {"torch": 25, "cpu": 25, "triton": 4}


@st.composite
def cases(draw):
    options = dict(
        loss_type=draw(st.sampled_from(list(objective.LOSS_TYPES))),  # (the table: a dict, in registration order)
        importance_sampling_level=draw(st.sampled_from(objective.IMPORTANCE_SAMPLING_LEVELS)),
        epsilon_high=draw(st.sampled_from([None, 0.28])),
        delta=draw(st.sampled_from([None, 1.5])),
    )
    ref = draw(st.booleans())
    if ref:
        options["beta"] = draw(st.sampled_from([0.0, 0.04]))
    return Case(
        B=draw(st.integers(1, 3)), T=draw(st.integers(1, 6)), H=draw(st.integers(1, 24)), V=draw(st.integers(1, 70)),
        bias=draw(st.booleans()), mask=draw(st.sampled_from(["random", "full", "empty_row", "one"])),
        adv_per_token=draw(st.booleans()), old_logp=draw(st.booleans()), ref_logp=ref,
        is_weights=draw(st.booleans()),
        options=loss_options(temperature=draw(st.sampled_from([0.7, 1.0, 1.3])), **options),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("backend", backend_params())
def test_fuzz_against_spec(backend):
    @settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def check(case):
        _check_against_spec(case, backend)

    check()


def test_fuzz_bf16():
    """bf16 on the cpu backend (its native bf16 slab path) across shapes."""

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(case=cases())
    def check(case):
        case.dtype = torch.bfloat16
        _check_against_spec(case, "cpu")

    check()

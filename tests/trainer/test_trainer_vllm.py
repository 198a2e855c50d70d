"""GRPOTrainer with the in-process vLLM engine on the tiny Llama: weights hot-swapped each step."""

import json
import os

import pytest

from grpo_fast.generation.engines import vllm_available
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


def test_vllm_engine_steps_with_weight_sync(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, engine="vllm", max_steps=3, eval_before_train=False, save_final=False,
               vllm_importance_sampling_correction=True,
               vllm_importance_sampling_mode="token_truncate", sampling_check_steps=1)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    assert not trainer.engine_shares_weights and trainer.use_is
    trainer.train()
    with open(os.path.join(c.output_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"reward"' in line]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in steps), "the policy did not receive a gradient"
    # steps 2 and 3 sample from weights that were trained (lr 3e-2) and hot-swapped into vLLM: the
    # engine's sampling log-probs must still be the policy's (a missed sync shows up as ~0.1-1)
    for r in steps:
        assert r["sampling/logp_diff_max"] < 1e-3, r
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, r
    assert steps[-1]["time/weight_sync"] > 0

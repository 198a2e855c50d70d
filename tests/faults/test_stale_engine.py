"""A weight swap that does not reach the engine is caught after the sync, not trained on."""

import json

import pytest

from grpo_fast.generation.engines import vllm_available
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


def test_skipped_weight_swap_is_an_error_after_one_resync(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, engine="vllm", max_steps=3, eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    real_update, calls = trainer.engine.update_weights, []

    def update_only_once(weights):  # the first sync lands, every later one is lost (as in trl#5312)
        calls.append(trainer.state.step)
        if len(calls) == 1:
            real_update(weights)

    trainer.engine.update_weights = update_only_once
    with pytest.raises(RuntimeError, match=r"out of sync with the policy after step 2: .* even after a second weight sync"):
        trainer.train()
    assert calls == [1, 2, 2], "expected a sync after step 1, then after step 2 one sync and one re-sync"
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["step"] == 1 and first["sampling/sync_check_diff"] < 1e-4  # a float32 engine in sync: ~1e-6

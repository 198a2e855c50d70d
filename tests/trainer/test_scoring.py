"""Reward scoring: TRL's calling convention, None ignored, NaN/inf counted, bad functions named."""

import math

import pytest
import torch

from grpo_fast.generation.batch import Rollouts
from grpo_fast.objective import group_advantages
from grpo_fast.train.logprobs import importance_weights
from grpo_fast.train.score import score


def _batch(n=4):
    return Rollouts(
        prompt_ids=[[1, 2]] * n, completion_ids=[[5, 6, 7][: i % 3 + 1] for i in range(n)],
        sampling_logp=[torch.zeros(1)] * n, finish_reason=["stop"] * n,
        completion_texts=[f"text {i}" for i in range(n)], rows=[{"prompt": "p", "answer": str(i)} for i in range(n)],
    )


def test_columns_arrive_as_lists_and_none_and_nonfinite_become_missing():
    seen = {}

    def f(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [1.0, None, math.nan, math.inf]

    batch = _batch()
    rewards, non_finite, _ = score([f], batch, "prompt", conversational=False)
    assert seen["answer"] == ["0", "1", "2", "3"] and seen["completions"] == batch.completion_texts
    assert rewards[0, 0] == 1.0 and rewards[1:, 0].isnan().all()
    assert non_finite == 2  # NaN and inf, not None
    # a group with one known reward: no signal, advantage 0 everywhere (objective's semantics)
    assert torch.equal(group_advantages(rewards, 4), torch.zeros(4))


def test_conversational_prompts_get_message_completions():
    got = {}

    def f(prompts, completions, completion_ids, **kwargs):
        got["c"] = completions
        return [0.0] * len(completions)

    score([f], _batch(2), "prompt", conversational=True)
    assert got["c"][0] == [{"role": "assistant", "content": "text 0"}]


def test_raising_reward_is_named():
    def broken(prompts, completions, completion_ids, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        score([broken], _batch(), "prompt", conversational=False)


@pytest.mark.parametrize("values, expected", [([1.0], "got 1 values"), (None, "got None"), ([1.0, "x", 0, 0], "returned 'x'")])
def test_wrong_output_is_named(values, expected):
    def short(prompts, completions, completion_ids, **kwargs):
        return values

    with pytest.raises(ValueError, match=f"reward function 'short'.*{expected}"):
        score([short], _batch(), "prompt", conversational=False)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_follow_trl_modes(mode):
    old = torch.tensor([-1.0, -2.0, -0.5])
    sampling = torch.tensor([-1.5, -0.5, -0.5])  # diffs +0.5, -1.5, 0 -> sum -1.0
    w = importance_weights(old, sampling, mode=mode, cap=1.5, clip_min=None)
    diff = (old - sampling).double()
    ratio = diff.sum().exp().expand(3) if mode.startswith("sequence") else diff.exp()
    expected = ratio.clamp(max=1.5) if mode.endswith("truncate") else torch.where(ratio > 1.5, 0.0, ratio)
    assert torch.allclose(w.double(), expected, atol=1e-6, rtol=1e-6), (w, expected)

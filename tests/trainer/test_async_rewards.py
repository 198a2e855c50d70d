"""Reward functions beyond one plain call: `async def` ones run concurrently (TRL's semantics), a
`takes_groups` one is called once per group in order, and a call past `reward_timeout` gives missing
values, is counted, and does not hold up the run."""

import asyncio
import math
import time

import torch

from grpo_fast.generation.batch import Rollouts
from grpo_fast.train.score import score
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction


def _batch(n=8):
    return Rollouts(prompt_ids=[[1]] * n, completion_ids=[[3 + i] for i in range(n)],
                    sampling_logp=[torch.zeros(1)] * n, finish_reason=["stop"] * n,
                    completion_texts=[f"c{i}" for i in range(n)], rows=[{"prompt": f"p{i // 4}"} for i in range(n)])


def test_async_reward_functions_overlap():
    spans = {}

    def sleeper(name):
        async def reward(prompts, completions, **kwargs):
            start = time.monotonic()
            await asyncio.sleep(0.5)
            spans[name] = (start, time.monotonic())
            return [1.0] * len(prompts)

        reward.__name__ = name
        return reward

    start = time.monotonic()
    rewards, _, timeouts = score([sleeper(f"r{k}") for k in range(3)], _batch(), "prompt", False)
    assert rewards.eq(1.0).all() and timeouts == {}
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values()), f"the calls did not overlap: {spans}"
    assert time.monotonic() - start < 1.4, "three 0.5 s calls took as long as in sequence"  # (a loose backstop)


def test_async_rewards_also_score_inside_a_running_event_loop():
    async def reward(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [2.0] * len(prompts)

    async def from_a_notebook():  # a loop already runs in this thread
        return score([reward], _batch(), "prompt", False)

    assert asyncio.run(from_a_notebook()).rewards.eq(2.0).all()


def test_a_group_reward_function_sees_each_group_once_whole_and_in_order():
    seen = []

    def rank(prompts, completions, **kwargs):
        seen.append((list(prompts), list(completions)))
        return [float(i) for i in range(len(completions))]  # a rank within the group

    rank.takes_groups = True
    rewards, _, _ = score([rank, target_fraction], _batch(), "prompt", False, group_size=4)
    assert seen == [(["p0"] * 4, ["c0", "c1", "c2", "c3"]), (["p1"] * 4, ["c4", "c5", "c6", "c7"])]
    assert rewards[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] * 2


def test_a_timed_out_call_is_counted_and_the_run_ends_in_normal_time(tmp_path, tiny):
    def stuck(prompts, completions, **kwargs):  # sync: abandoned in its daemon thread
        time.sleep(600)

    async def stuck_async(prompts, completions, **kwargs):  # async: cancelled
        await asyncio.sleep(600)

    start = time.monotonic()
    rewards, _, timeouts = score([stuck, stuck_async, target_fraction], _batch(), "prompt", False, timeout=0.3)
    assert timeouts == {"stuck": 1, "stuck_async": 1} and rewards[:, :2].isnan().all()
    assert not rewards[:, 2].isnan().any()
    assert time.monotonic() - start < 5

    c = config(tmp_path, max_steps=2, eval_before_train=False, save_final=False, report_to="none", reward_timeout=0.3,
               reward_funcs=["target_fraction", "stuck"])
    start = time.monotonic()
    last = GRPOTrainer(c, [target_fraction, stuck], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    assert time.monotonic() - start < 60, "the stuck reward held up the run"
    assert last["rewards/stuck/timeouts"] == 1 and last["rewards/target_fraction/timeouts"] == 0
    assert math.isfinite(last["loss"])

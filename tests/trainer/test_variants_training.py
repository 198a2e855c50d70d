"""The GRPO variants in the trainer: advantages from scored batches (grpo_fast/train/advantages.py)
against hand-computed numbers, and runs of each rollout mode on the tiny model."""

import json
import math

import pytest
import torch

from grpo_fast import objective
from grpo_fast.generation.batch import Rollouts
from grpo_fast.reporting.metrics import combine
from grpo_fast.train import advantages, score
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction


def _scored(rewards, kind=None):
    rewards = torch.tensor(rewards, dtype=torch.float64).reshape(len(rewards), -1)
    n = rewards.shape[0]
    return Rollouts(prompt_ids=[[1]] * n, completion_ids=[[2, 3]] * n, sampling_logp=[torch.zeros(2)] * n,
                    finish_reason=["stop"] * n, completion_texts=[f"c{i}" for i in range(n)],
                    rows=[{"prompt": "p", "i": i} for i in range(n)], rewards=rewards, kind=kind)


def test_partial_credit_judges_only_all_wrong_groups(tmp_path):
    seen = []

    def judge(prompts, completions, completion_ids, i, **kw):
        seen.extend(i)
        return [{0: 1.0, 1: 0.0, 2: 0.5}[j] for j in i]

    c = config(tmp_path, num_generations=3, per_device_train_batch_size=6, partial_credit_judge="x:y",
               partial_credit_beta=5.0, partial_credit_gamma=0.5)
    batch = _scored([0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    adv, stats = advantages.advantages(batch, c, judge)
    assert seen == [0, 1, 2], "the judge sees the completions of groups with no right answer, and only those"
    credit = [1 / (1 + math.exp(-2.5)), 1 / (1 + math.exp(2.5)), 0.5]
    expected = objective.group_advantages(torch.tensor(credit + [1.0, 0.0, 1.0]), 3)
    assert torch.allclose(adv, expected, rtol=1e-5, atol=1e-6) and stats["partial_credit/frac_groups"] == 0.5
    assert batch.rewards[0, 0] == 0.0, "the scored rewards stay as they were (logged as scored)"


def test_partial_credit_judge_scores_outside_0_1_are_an_error(tmp_path):
    c = config(tmp_path, num_generations=2, per_device_train_batch_size=4, partial_credit_judge="x:y")
    with pytest.raises(ValueError, match=r"partial_credit_judge='x:y': expected scores in \[0, 1\], got values in \[0.0, 3.0\]"):
        advantages.advantages(_scored([0.0, 0.0, 1.0, 0.0]), c, lambda prompts, completions, completion_ids, **kw: [3.0, 0.0])


def test_lead_options_reach_the_reward(tmp_path, tiny_path):
    c = config(tmp_path, model=tiny_path, reward_funcs=["lead"], lead_alpha=0.2, lead_wrong_reward=-0.5, task_train_size=8)
    trainer = GRPOTrainer.from_config(c)
    lead = trainer.reward_funcs[0]
    assert (lead.alpha, lead.wrong_reward, lead.group) == (0.2, -0.5, 4)


def test_variant_options_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match=r"reward_noise_rate=0.2 .*reward_funcs\[0\]='lead'"):
        config(tmp_path, reward_funcs=["lead"], reward_noise_rate=0.2)
    with pytest.raises(ValueError, match="early_exit_text"):
        config(tmp_path, rollout_mode="early_exit", early_exit_text=None)
    with pytest.raises(ValueError, match="answers_per_thought"):
        config(tmp_path, rollout_mode="multi_answer", answers_per_thought=0)
    with pytest.raises(ValueError, match="reward_noise_rate"):
        config(tmp_path, reward_noise_rate=0.5)


def test_difficulty_and_noise_weights_multiply_group_advantages(tmp_path):
    c = config(tmp_path, num_generations=4, difficulty_weighting=True, reward_noise_rate=0.1)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # a hard prompt (1/4 right), an easy one (3/4)
    adv, stats = advantages.advantages(_scored(rewards), c)
    plain = objective.group_advantages(torch.tensor(rewards), 4)
    w = lambda x: 0.4 + 1.1 / (1 + math.exp(10 * (x - 0.75)))  # noqa: E731
    # hard prompt: its success weighs w(1/4) ~ 1.49, its failures w(3/4) = 0.95; the easy one the reverse
    difficulty = [w(0.25), w(0.75), w(0.75), w(0.75), w(0.75), w(0.75), w(0.75), w(0.25)]
    noise = objective.noise_aware_weights(torch.tensor(rewards), 4, p=0.1)  # 0.72 for 1/4 and 3/4 right (G=8 table)
    assert torch.allclose(adv, plain * torch.tensor(difficulty) * noise, rtol=1e-5, atol=1e-6)
    assert 0.6 < stats["noise_aware/weight_mean"] < 0.8
    bad = config(tmp_path, num_generations=4, reward_noise_rate=0.2)
    with pytest.raises(ValueError, match=r"reward_noise_rate=0.2 needs the first reward function's values in \[0, 1\]"):
        advantages.advantages(_scored([2.0, 0.0, 0.0, 0.0]), bad)


def test_early_exit_advantages_are_decaying_rewards_minus_their_mean(tmp_path):
    c = config(tmp_path, rollout_mode="early_exit", early_exit_points=3, num_generations=4)
    adv, stats = advantages.advantages(_scored([0.0, 1.0, 1.0, 0.7, 0.0, 0.0, 0.0, 0.0]), c)
    assert torch.allclose(adv, torch.tensor([-0.4375, 0.5625, 0.0625, -0.1875, 0, 0, 0, 0]))
    assert stats["early_exit/first_correct_exit"] == 1.0


def _funcs(*names):
    out = []
    for name in names:
        f = lambda prompts, completions, completion_ids, **kw: None  # noqa: E731 (named only: reward_metrics reads the name)
        f.__name__ = name
        out.append(f)
    return out


def test_early_exit_adds_the_other_weighted_rewards_to_the_serial_reward(tmp_path):
    """The first reward's correctness becomes the serial reward; the second is added with its weight,
    as in parallel mode (a missing value counts as nothing); the logged reward is their weighted mean."""
    c = config(tmp_path, rollout_mode="early_exit", early_exit_points=3, num_generations=4, reward_funcs=["v", "short"],
               reward_weights=[2.0, 0.5])
    batch = _scored([[0.0, 0.2], [1.0, 0.4], [1.0, math.nan], [0.7, -0.8]])
    batch.advantages, _ = advantages.advantages(batch, c)
    adv = batch.advantages
    total = torch.tensor([2 * 0.0 + 0.5 * 0.2, 2 * 1.0 + 0.5 * 0.4, 2 * 0.5, 2 * 0.25 + 0.5 * -0.8], dtype=torch.float64)
    assert torch.allclose(adv, (total - total.mean()).float(), rtol=1e-6), (adv, total - total.mean())
    assert batch.trained_rewards[:, 0].tolist() == [0.0, 1.0, 0.5, 0.25] and batch.rewards[0, 1] == 0.2
    logged = combine([score.reward_metrics(batch, _funcs("v", "short"), c)])
    assert logged["reward"] == pytest.approx(total.mean().item(), rel=1e-12), "the logged reward is what trained"
    assert logged["rewards/v/mean"] == pytest.approx(2.7 / 4, rel=1e-12), "each function's own values as scored"
    heavier = config(tmp_path, rollout_mode="early_exit", early_exit_points=3, num_generations=4,
                     reward_funcs=["v", "short"], reward_weights=[2.0, 5.0])
    assert not torch.allclose(advantages.advantages(batch, heavier)[0], adv), "the second weight reaches the advantages"


def test_partial_credit_is_logged_as_it_trained(tmp_path):
    c = config(tmp_path, num_generations=2, per_device_train_batch_size=4, partial_credit_judge="x:y",
               partial_credit_beta=5.0, partial_credit_gamma=0.5)
    batch = _scored([0.0, 0.0, 1.0, 0.0])
    batch.advantages, _ = advantages.advantages(batch, c, lambda prompts, completions, completion_ids, **kw: [1.0, 0.0])
    credit = [1 / (1 + math.exp(-2.5)), 1 / (1 + math.exp(2.5))]
    logged = combine([score.reward_metrics(batch, _funcs("v"), c)])
    assert logged["reward"] == pytest.approx((sum(credit) + 1.0) / 4, rel=1e-6)
    assert logged["rewards/v/mean"] == 0.25


def test_rollout_modes_refuse_what_they_cannot_train(tmp_path):
    early = dict(rollout_mode="early_exit", early_exit_points=3, num_generations=4)
    for first in ("lead", "math_length"):  # the serial reward would replace their length term
        with pytest.raises(ValueError, match=rf"reward_funcs=\['{first}'\].*rollout_mode='early_exit'.*length term"):
            config(tmp_path, reward_funcs=[first], **early)
    assert config(tmp_path, reward_funcs=["math", "lead"], reward_weights=[1.0, 0.5], **early).reward_funcs[1] == "lead"
    multi = dict(rollout_mode="multi_answer", num_generations=2, answers_per_thought=2, per_device_train_batch_size=12)
    for mode in (early, multi):
        with pytest.raises(ValueError, match=r"multi_objective_aggregation='normalize_then_sum'.*'sum_then_normalize' with "
                                             rf"rollout_mode='{mode['rollout_mode']}'"):
            config(tmp_path, reward_funcs=["a", "b"], multi_objective_aggregation="normalize_then_sum", **mode)
    with pytest.raises(ValueError, match=r"early_exit_points=9.*at most max_completion_length \(8\).*coincide"):
        config(tmp_path, rollout_mode="early_exit", early_exit_points=9, num_generations=10, per_device_train_batch_size=20,
               max_completion_length=8)


def test_multi_answer_lead_groups_a_prompts_answers(tmp_path, tiny_path):
    c = config(tmp_path, model=tiny_path, reward_funcs=["lead"], rollout_mode="multi_answer", num_generations=2,
               answers_per_thought=3, per_device_train_batch_size=16, task_train_size=8)
    assert GRPOTrainer.from_config(c).reward_funcs[0].group == 6, "lead's z-scores over a prompt's K x M answers"


def test_multi_answer_advantages_per_thought_and_per_answer(tmp_path):
    c = config(tmp_path, rollout_mode="multi_answer", num_generations=2, answers_per_thought=2, per_device_train_batch_size=6)
    nan = math.nan
    batch = _scored([nan, nan, 1.0, 1.0, 0.0, 1.0], kind=["thought"] * 2 + ["answer"] * 4)
    adv, _ = advantages.advantages(batch, c)
    s = math.sqrt(0.75 * 0.25)
    expected = [0.25 / (0.25 + 1e-4), -0.25 / (0.25 + 1e-4), 0.25 / (s + 1e-4), 0.25 / (s + 1e-4),
                -0.75 / (s + 1e-4), 0.25 / (s + 1e-4)]
    assert torch.allclose(adv, torch.tensor(expected), rtol=1e-5)
    assert c.group_size == 6


def _train(tmp_path, tiny, **overrides):
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=1, eval_before_train=False, **overrides)
    trainer = GRPOTrainer(c, [target_fraction], rows(), rows(4), model=model, tokenizer=tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = trainer.train()
    moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    return trainer, metrics, moved


def _step_line(trainer) -> dict:
    with open(trainer.metrics_logger.path) as f:
        return next(line for line in map(json.loads, f) if "loss" in line)


def test_early_exit_run_trains_on_serial_groups(tmp_path, tiny):
    trainer, _, moved = _train(tmp_path, tiny, rollout_mode="early_exit", early_exit_points=3, num_generations=4,
                               early_exit_text="ANSWER:", early_exit_answer_length=4)
    assert moved and trainer.state.generation_calls == 2, "a full completion, then the answers of its cuts"
    assert "early_exit/serial_reward_mean" in _step_line(trainer)


def test_early_exit_second_reward_weight_changes_the_update(tmp_path, tiny_path):
    """Two reward functions with weights: the second weight reaches the update (it did not: the serial
    reward alone trained while the logged reward included it), and the logged reward is the weighted
    sum that trained: the serial reward's mean plus the second weight times the second reward's mean."""
    from tests.tiny_model import load_tiny_model

    def shorter(prompts, completions, completion_ids, **kw):  # differs within a serial group: cuts are shorter
        return [-len(ids) / 8 for ids in completion_ids]

    runs = []
    for weight in (0.1, 3.0):
        model, tokenizer = load_tiny_model(tiny_path)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        c = config(tmp_path / f"w{weight}", max_steps=1, eval_before_train=False, rollout_mode="early_exit",
                   early_exit_points=3, num_generations=4, early_exit_text="ANSWER:", early_exit_answer_length=4,
                   reward_funcs=["target_fraction", "shorter"], reward_weights=[1.0, weight])
        trainer = GRPOTrainer(c, [target_fraction, shorter], rows(), model=model, tokenizer=tokenizer)
        trainer.train()
        line = _step_line(trainer)
        update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        runs.append((line, update))
        assert line["reward"] == pytest.approx(line["early_exit/serial_reward_mean"] + weight * line["rewards/shorter/mean"],
                                               rel=1e-9), "the logged reward is the combined reward that trained"
    (a, update_a), (b, update_b) = runs
    assert a["rewards/shorter/mean"] == b["rewards/shorter/mean"] != 0, "the same samples in both runs"
    assert not b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (a["grad_norm"], b["grad_norm"])
    diff = max((update_a[n] - update_b[n]).abs().max().item() for n in update_a)
    size = max(u.abs().max().item() for u in update_a.values())
    assert diff > 1e-2 * size, f"the updates differ by {diff:.3g} at most (largest update {size:.3g})"


def test_multi_answer_run_trains_thoughts_and_answers(tmp_path, tiny):
    trainer, _, moved = _train(tmp_path, tiny, rollout_mode="multi_answer", num_generations=2, answers_per_thought=2,
                               per_device_train_batch_size=12, max_thought_length=4, max_completion_length=4)
    assert moved and trainer.state.generation_calls == 2, "thoughts, then answers"
    assert trainer.config.prompts_per_generation == 2, "a step trains per_device_train_batch_size sequences: thoughts and answers"
    assert trainer.group_size == 6 and "multi_answer/thought_advantage_abs_mean" in _step_line(trainer)


def test_eval_accuracy_is_the_share_of_right_answers_whatever_the_shaping(tmp_path, tiny):
    model, tokenizer = tiny

    def shaped(prompts, completions, completion_ids, **kw):  # a lead-like reward: wrong -1, right in (0, 2)
        return [1.5 if i % 4 == 0 else -1.0 for i in range(len(completions))]

    trainer = GRPOTrainer(config(tmp_path), [shaped], rows(), rows(8), model=model, tokenizer=tokenizer)
    out = trainer.evaluate()
    assert out["eval/accuracy"] == 0.25 and out["eval/reward"] < 0
    assert out["eval/completions/mean_length_correct"] > 0

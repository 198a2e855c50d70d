"""The GRPO variants' pure functions (grpo_fast.objective) against hand-computed numbers."""

import math

import pytest
import torch

from grpo_fast import (
    decaying_serial_rewards,
    difficulty_weights,
    lead_length_rewards,
    noise_aware_weights,
    partial_credit_rewards,
    thought_answer_advantages,
)
from tests.helpers import assert_close, scaled


def test_noise_aware_weights_g8_p01():
    """The worked example: G = 8, p = 0.1, 0..8 correct answers."""
    got = [float(noise_aware_weights(torch.tensor([1.0] * k + [0.0] * (8 - k)), 8, p=0.1)[0]) for k in range(9)]
    assert got == pytest.approx([0, 0.42, 0.72, 0.78, 0.80, 0.78, 0.72, 0.42, 0], abs=5e-3)
    one_correct = (1 - 0.2) * (0.03125 * 0.96875) / (math.sqrt(0.125 * 0.875) * math.sqrt(0.03125 * 0.96875))
    assert got[1] == pytest.approx(one_correct, rel=1e-5)
    assert noise_aware_weights(torch.tensor([1.0, 0.0] * 2), 2, p=0.0).tolist() == pytest.approx([1.0] * 4, rel=1e-6)


@pytest.mark.parametrize("rewards, p, match", [
    (torch.tensor([1.0, -1.0]), 0.1, r"noise_aware_weights: rewards must lie in \[0, 1\]"),
    (torch.tensor([1.0, 0.0]), 0.5, r"p \(the reward flip rate\) must be in \[0, 0.5\)"),
    (torch.tensor([1.0, 0.0, 1.0]), 0.1, r"multiple of num_generations"),
])
def test_noise_aware_weights_bad_input(rewards, p, match):
    with pytest.raises(ValueError, match=match):
        noise_aware_weights(rewards, 2, p=p)


def test_lead_length_rewards_by_hand():
    # group 1: correct lengths 10, 20, 30 -> mu 20, sample std 10; group 2: one correct (sigma 1), none
    correct = torch.tensor([1, 1, 0, 1, 0, 1, 0, 0])
    lengths = torch.tensor([10, 20, 5, 30, 7, 9, 11, 13])
    got = lead_length_rewards(correct, lengths, 4, alpha=0.05)
    expected = [math.exp(0.05 * 1), 1.0, -1.0, math.exp(-0.05 * 1), -1.0, 1.0, -1.0, -1.0]
    assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=scaled(1e-6, torch.tensor(expected)), name="lead rewards")
    assert lead_length_rewards(torch.tensor([0, 0]), torch.tensor([3, 4]), 2, wrong_reward=0.0).tolist() == [0.0, 0.0]


def test_difficulty_weights_by_hand():
    w = lambda x: 0.4 + 1.1 / (1 + math.exp(10 * (x - 0.75)))  # noqa: E731
    adv = torch.tensor([1.0, -0.5, -0.5, 0.0])
    correct = torch.tensor([1, 0, 0, 0])  # rho = 0.25: a hard prompt, its one right answer counts more
    got = difficulty_weights(adv, correct, 4)
    expected = [1.0 * w(0.25), -0.5 * w(0.75), -0.5 * w(0.75), 0.0]
    assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=scaled(1e-6, torch.tensor(expected)), name="difficulty weights")
    assert w(0.25) > 1.4 and w(0.75) == pytest.approx(0.95)


def test_decaying_serial_rewards_by_hand():
    assert decaying_serial_rewards(torch.tensor([0, 1, 0, 1, 1])).tolist() == [0.0, 1.0, 0.0, 0.5, 0.25]
    assert decaying_serial_rewards(torch.tensor([1, 1, 1, 1])).tolist() == [1.0, 0.5, 0.25, 0.125]
    assert decaying_serial_rewards(torch.tensor([False, False])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="decaying_serial_rewards"):
        decaying_serial_rewards(torch.zeros(2, 3))


def test_thought_answer_advantages_by_hand():
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    thought, answer = thought_answer_advantages(rewards, eps=0.0 + 1e-4)
    # prompt 0: V = (0.5, 1.0), mean 0.75, population std 0.25 -> -1, +1
    assert_close(thought[0], torch.tensor([-0.25 / 0.2501, 0.25 / 0.2501]), atol=scaled(1e-6, thought[0]), name="thought advantages")
    # answers 1, 0, 1, 1: mean 0.75, std sqrt(3)/4
    s = math.sqrt(3) / 4 + 1e-4
    assert_close(answer[0], torch.tensor([[0.25 / s, -0.75 / s], [0.25 / s, 0.25 / s]]), atol=scaled(1e-6, answer[0]), name="answers")
    assert thought[1].abs().max() == 0 and answer[1].abs().max() == 0  # all equal: no signal
    with pytest.raises(ValueError, match=r"thought_answer_advantages: rewards must be \[P, K, M\]"):
        thought_answer_advantages(torch.zeros(4, 2))


def test_partial_credit_rewards_by_hand():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0])
    correct = torch.tensor([0, 0, 1, 0])
    scores = torch.tensor([0.2, 0.8, 0.5, 0.0])
    got = partial_credit_rewards(rewards, correct, scores, 2, beta=5.0, gamma=0.5)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [sig(5 * -0.3), sig(5 * 0.3), 1.0, 0.0]  # group 2 has a correct answer: unchanged
    assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=scaled(1e-6, torch.tensor(expected)), name="partial credit")
    with pytest.raises(ValueError, match=r"step_scores must lie in \[0, 1\]"):
        partial_credit_rewards(rewards, correct, torch.tensor([0.2, 1.5, 0.5, 0.0]), 2)

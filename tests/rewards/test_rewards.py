"""Worked cases for the built-in rewards: answers, format, overlong shaping, the registry."""

from __future__ import annotations

import signal
import threading

import pytest

from grpo_fast.rewards import (
    LengthAwareMathReward,
    completion_text,
    final_answer,
    format_reward,
    get_reward_funcs,
    math_reward,
    overlong_penalty,
    reward_name,
)


def score(completions, answers):
    return math_reward(prompts=["q"] * len(completions), completions=completions, completion_ids=None, answer=answers)


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{19}.", "19"),
        ("\\boxed{3} no wait \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("12 + 7 = 19, I think.", "19"),  # last-number fallback
        ("5-3", "3"),  # "-" after a digit is an operator, not a sign
        ("it is -4", "-4"),
        ("about 1,000 apples", "1000"),
        ("\\boxed{} then 7", "7"),  # an empty box does not count
        ("no digits here", None),
        ("\\boxed{5", "5"),  # unclosed box: falls back to the last number
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_completion_text_conversational():
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a\nb"
    assert (
        completion_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}]) == "x"
    )
    assert completion_text({"role": "assistant", "content": None}) == ""


# ----------------------------------------------------------------------------- math


def test_math_reward_worked_cases():
    completions = [
        "12 + 7 = \\boxed{19}",  # boxed, right
        "12 + 7 = \\boxed{18}",  # boxed, wrong
        "12 + 7 = 19",  # last-number fallback, right
        "19 is close, but it is 20",  # last number is wrong
        "half: \\boxed{\\frac{1}{2}}",  # LaTeX fraction vs LaTeX gold
        "half: \\boxed{0.5}",  # decimal vs LaTeX gold
        "\\boxed{\\frac{1}{3}}",  # wrong fraction
        "\\boxed{19.0}",  # number gold given as int
    ]
    answers = ["19", "19", "19", "19", "\\frac{1}{2}", "$\\frac{1}{2}$", "\\frac{1}{2}", 19]
    assert score(completions, answers) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_math_reward_none_answers():
    assert score(["\\boxed{1}", "\\boxed{2}"], [None, "2"]) == [None, 1.0]
    # no answer column at all: no reward for any row
    assert math_reward(prompts=["q"], completions=["\\boxed{1}"], completion_ids=None) == [None]


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "}}}{{{\\boxed{",
        "\\boxed{\\frac{\\frac{}{}}",
        "\\boxed{\\sqrt[}",
        "\x00\xff" * 50,
        "\\boxed{" + "(" * 500 + "}",
        "\\boxed{1/0}",
        "\\boxed{x=}",
    ],
)
def test_math_reward_never_raises_on_garbage(garbage):
    assert score([garbage], ["3"]) == [0.0]


def test_math_reward_conversational():
    completions = [[{"role": "assistant", "content": "It is \\boxed{7}."}], [{"role": "assistant", "content": "8"}]]
    assert score(completions, ["7", "7"]) == [1.0, 0.0]


def test_math_reward_off_main_thread():
    # math-verify's signal-based timeout raises off the main thread: the reward must not.
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", score(["\\boxed{19}", "18"], ["19", "19"])))
    t.start()
    t.join()
    assert out["r"] == [1.0, 0.0]


def test_math_reward_keeps_a_pending_alarm():
    # math-verify's signal.alarm would cancel an alarm set by someone else (pytest-timeout, the user).
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert score(["\\boxed{19}"], ["19"]) == [1.0]
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 90
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_math_reward_checks_column_length():
    with pytest.raises(ValueError, match="answer.*expected 2 entries"):
        score(["1", "2"], ["1"])


# ----------------------------------------------------------------------------- format


def test_format_reward():
    completions = [
        "\\boxed{19}",  # one non-empty box
        "x \\boxed{ 3 } y",
        "\\boxed{}",  # empty
        "\\boxed{  }",  # blank
        "\\boxed{1} or \\boxed{2}",  # two boxes
        "19",  # none
        "\\boxed{19",  # unclosed
        [{"role": "assistant", "content": "\\boxed{\\frac{1}{2}}"}],
    ]
    assert format_reward(prompts=None, completions=completions, completion_ids=None) == [1, 1, 0, 0, 0, 0, 0, 1]


# ----------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_boundaries():
    # L_max = 100, buffer 20: no penalty up to 80, linear to -1 at 100, -1 beyond.
    expect = {0: 0.0, 80: 0.0, 81: -1 / 20, 90: -0.5, 99: -19 / 20, 100: -1.0, 101: -1.0}
    for length, value in expect.items():
        assert overlong_penalty(length, 100, 20) == pytest.approx(value), length


def test_length_aware_math_reward():
    f = LengthAwareMathReward(max_completion_length=8, buffer=4)
    assert f.__name__ == "math_length"
    completions = ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "\\boxed{1}"]
    lengths = [4, 6, 8, 4, 7, 3]
    answers = ["1", "1", "1", "1", "1", None]
    out = f(prompts=None, completions=completions, completion_ids=[[0] * n for n in lengths], answer=answers)
    # right: 1 + penalty; wrong: 0 + penalty; penalty = (8 - 4 - L) / 4 when 4 < L <= 8
    assert out == pytest.approx([1.0, 0.5, 0.0, 0.0, -0.75, None])


def test_length_aware_math_reward_validation():
    with pytest.raises(ValueError, match="buffer"):
        LengthAwareMathReward(8, buffer=9)
    with pytest.raises(ValueError, match="max_completion_length"):
        LengthAwareMathReward(0)
    assert LengthAwareMathReward(100).buffer == 25
    with pytest.raises(ValueError, match="completion_ids"):
        LengthAwareMathReward(8)(prompts=None, completions=["1"], completion_ids=None, answer=["1"])


# ----------------------------------------------------------------------------- registry


def test_get_reward_funcs_builtins():
    funcs = get_reward_funcs(["math", "format", "math_length"], max_completion_length=64, buffer=16, unrelated=1)
    assert [reward_name(f) for f in funcs] == ["math", "format", "math_length"]
    assert funcs[0] is math_reward and funcs[1] is format_reward
    assert (funcs[2].max_completion_length, funcs[2].buffer) == (64, 16)
    assert [reward_name(f) for f in get_reward_funcs("math, format")] == ["math", "format"]


def test_get_reward_funcs_import_path():
    (f,) = get_reward_funcs("tests.rewards.user_rewards:length_reward")
    assert reward_name(f) == "length_reward"
    assert f(prompts=None, completions=["ab", "abc"]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        get_reward_funcs("tests.rewards.user_rewards:missing")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward_funcs("tests.rewards.no_such_module:f")
    with pytest.raises(ValueError, match="expected a callable"):
        get_reward_funcs("tests.rewards.user_rewards:NOT_CALLABLE")


def test_get_reward_funcs_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"unknown reward 'maths'.*\['chain_steps', 'code_tests', 'format', 'judge_rank', 'judge_score', 'lead', 'math', 'math_boxed', 'math_length'\]"):
        get_reward_funcs(["math", "maths"])
    with pytest.raises(ValueError, match="max_completion_length"):
        get_reward_funcs("math_length")  # needs its option


def test_boxed_math_reward_counts_only_boxed_correct_answers():
    from grpo_fast.rewards import boxed_math_reward

    completions = ["so \\boxed{9}", "the answer is 9", "\\boxed{8}", "\\boxed{9} or \\boxed{9}"]
    assert boxed_math_reward(completions=completions, answer=["9"] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert boxed_math_reward(completions=["\\boxed{9}"], answer=[None]) == [None]
    assert reward_name(get_reward_funcs("math_boxed")[0]) == "math_boxed"


def test_chain_steps_counts_right_results_before_the_first_wrong_one():
    from grpo_fast.rewards import chain_steps

    steps = [["12", "36", "32"]] * 5
    completions = ["7 + 5 = 12\n12 × 3 = 36\n36 − 4 = 32\n\\boxed{32}", "7 + 5 = 12\n12 × 3 = 35\n35 - 4 = 31",
                   "7 + 5 = 13\n13 × 3 = 39 = 36", "no equations, \\boxed{32}", [{"role": "assistant", "content": "=12 =36"}]]
    assert chain_steps(completions=completions, steps=steps) == pytest.approx([1.0, 1 / 3, 0.0, 0.0, 2 / 3])
    assert chain_steps(completions=["= 1"], steps=None) == [None]


def test_lead_reward_shorter_right_answers_earn_more_per_prompt_run():
    import torch

    from grpo_fast.objective import lead_length_rewards
    from grpo_fast.rewards import LeadReward

    f = get_reward_funcs(["lead"], lead_alpha=0.5, lead_wrong_reward=-2.0)[0]
    assert isinstance(f, LeadReward) and f.__name__ == "lead"
    prompts = ["p"] * 4 + ["q"] * 2
    completions = ["\\boxed{7}", "so 7", "\\boxed{8}", "it is 7", "7", "\\boxed{9}"]
    ids = [[1] * 3, [1] * 9, [1] * 2, [1] * 6, [1] * 4, [1] * 4]
    got = f(prompts=prompts, completions=completions, completion_ids=ids, answer=["7"] * 6)
    lengths, ok = torch.tensor([3.0, 9, 2, 6]), torch.tensor([True, True, False, True])
    assert got[:4] == pytest.approx(lead_length_rewards(ok, lengths, 4, alpha=0.5, wrong_reward=-2.0).tolist())
    assert got[0] > got[3] > got[1] > 0 > got[2] == -2.0
    assert got[4:] == pytest.approx([1.0, -2.0])  # one right answer in its group: exp(0)
    with pytest.raises(ValueError, match="lead_alpha"):
        LeadReward(lead_alpha=-1)
    # one prompt's groups one after the other (a repeated question, an epoch wrapping in a batch):
    # each group of num_generations is shaped on its own
    grouped = get_reward_funcs(["lead"], lead_alpha=0.5, lead_wrong_reward=-2.0, num_generations=2)[0]
    two = grouped(prompts=["p"] * 4, completions=completions[:4], completion_ids=ids[:4], answer=["7"] * 4)
    first = lead_length_rewards(torch.tensor([True, True]), torch.tensor([3.0, 9]), 2, alpha=0.5, wrong_reward=-2.0)
    assert two == pytest.approx(first.tolist() + [-2.0, 1.0])

"""The built-in arithmetic task: right answers, determinism, disjoint train/test."""

from __future__ import annotations

import pytest

from grpo_fast.data import arithmetic_rows
from grpo_fast.data.tasks import DIFFICULTIES


def evaluate(question: str) -> int:
    a, op, b = question.split()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "×": a * b}[op]


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_answers_are_right_and_prompts_ask_for_boxed(difficulty):
    rows = arithmetic_rows(200, seed=1, difficulty=difficulty)
    for r in rows:
        assert r["answer"] == str(evaluate(r["question"]))
        assert r["question"] in r["prompt"] and "\\boxed{}" in r["prompt"]
        assert int(r["answer"]) >= 0


def test_deterministic_by_seed():
    assert arithmetic_rows(50, seed=3) == arithmetic_rows(50, seed=3)
    assert arithmetic_rows(50, seed=3) != arithmetic_rows(50, seed=4)
    # a smaller n with the same seed is a prefix: evaluation sets grow without reshuffling
    assert arithmetic_rows(20, seed=3, split="test") == arithmetic_rows(50, seed=3, split="test")[:20]


def test_train_test_disjoint_whatever_the_seed():
    train = {r["question"] for r in arithmetic_rows(seed=0)}
    for seed in (0, 1, 2):
        test = {r["question"] for r in arithmetic_rows(seed=seed, split="test")}
        assert test and not (train & test)
    # the whole split once, and the held-out share is about 20 %
    assert len(train) == len(arithmetic_rows(seed=5))
    assert 0.15 < len(test) / (len(train) + len(test)) < 0.25


def test_more_rows_than_questions_repeat():
    pool = len(arithmetic_rows(split="test"))
    rows = arithmetic_rows(pool + 10, split="test")
    assert len(rows) == pool + 10 and len({r["question"] for r in rows}) == pool


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        arithmetic_rows(5, split="validation")
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_rows(5, difficulty="insane")
    with pytest.raises(ValueError, match="n: expected"):
        arithmetic_rows(0)


def test_chain_arithmetic_steps_answers_and_disjoint_splits():
    from grpo_fast.data.tasks import chain_arithmetic_rows, task_rows

    rows = chain_arithmetic_rows(300, seed=2)
    for r in rows:  # the question, evaluated independently, gives the steps and the answer
        expr = r["question"].replace("×", "*").replace("−", "-")
        assert str(eval(expr)) == r["answer"] == r["steps"][-1]  # noqa: S307 (digits and + - * only)
        inner = expr[expr.rindex("(") + 1 : expr.index(")")]
        assert str(eval(inner)) == r["steps"][0]  # noqa: S307
        assert len(r["steps"]) == 3 and all(int(s) >= 0 for s in r["steps"])
        assert r["question"] in r["prompt"] and "\\boxed{}" in r["prompt"]
    assert chain_arithmetic_rows(40, seed=2) == rows[:40] and chain_arithmetic_rows(40, seed=3) != rows[:40]
    test = {r["question"] for r in chain_arithmetic_rows(500, seed=2, split="test")}
    assert test and not test & {r["question"] for r in chain_arithmetic_rows(2000, seed=5)}
    assert task_rows("chain_arithmetic:7") == chain_arithmetic_rows(7)

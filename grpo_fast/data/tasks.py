"""Built-in synthetic tasks: prompt datasets generated on the spot, no files, no downloads.

``arithmetic``: small integer questions ("What is 12 + 7?") with the gold answer in the ``answer``
column, checked by the ``math`` reward. Easy on purpose: SmolLM2-135M-Instruct already gets some
right and rarely uses ``\\boxed{}``, so the reward has room to climb within minutes on a CPU.
"""

from __future__ import annotations

import hashlib
import random

# difficulty -> (largest operand, operators). Subtraction keeps a >= b (no negative answers);
# multiplication operands stay <= 12 (times tables).
DIFFICULTIES: dict[str, tuple[int, str]] = {
    "easy": (30, "+-"),
    "medium": (99, "+-"),
    "hard": (99, "+-*"),
}
_MAX_MUL_OPERAND = 12
SPLITS = ("train", "test")
TEST_FRACTION_PERCENT = 20  # share of the questions held out for "test"

ARITHMETIC_INSTRUCTION = "Put your final answer within \\boxed{}."


def _questions(difficulty: str) -> list[tuple[int, str, int]]:
    """Every (a, op, b) of a difficulty, in a fixed order."""
    top, ops = DIFFICULTIES[difficulty]
    out = []
    for op in ops:
        hi = _MAX_MUL_OPERAND if op == "*" else top
        for a in range(hi + 1):
            for b in range(hi + 1):
                if op == "-" and b > a:
                    continue
                out.append((a, op, b))
    return out


def question_split(a: int, op: str, b: int) -> str:
    """The split of a question, "train" or "test", from a hash of its text.

    The same for every seed and size, so held-out questions never appear in training.
    """
    digest = hashlib.sha256(f"{a} {op} {b}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "little") % 100 < TEST_FRACTION_PERCENT else "train"


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _row(a: int, op: str, b: int) -> dict:
    shown = "×" if op == "*" else op
    question = f"{a} {shown} {b}"
    return {
        "prompt": f"What is {question}? {ARITHMETIC_INSTRUCTION}",
        "answer": str(_answer(a, op, b)),
        "question": question,
    }


def arithmetic_rows(
    n: int | None = None, *, seed: int = 0, split: str = "train", difficulty: str = "easy"
) -> list[dict]:
    """Arithmetic questions as rows ``{"prompt": str, "answer": str, "question": str}``.

    Args:
        n: number of rows; None gives every question of the split once (easy: about 1170 train,
            290 test). When n exceeds the split's question count, questions repeat (each pass
            reshuffled).
        seed: the order (and the choice, when n is smaller) is a deterministic function of it.
        split: "train" or "test"; the two share no question, whatever the seed or n.
        difficulty: "easy" (operands 0..30, + and -), "medium" (0..99, + and -),
            "hard" (medium plus times tables up to 12 × 12).
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty: expected one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"n: expected a positive int or None, got {n!r}")
    pool = [q for q in _questions(difficulty) if question_split(*q) == split]
    rng = random.Random(f"{seed}-{split}-{difficulty}")
    n = len(pool) if n is None else n
    chosen: list[tuple[int, str, int]] = []
    while len(chosen) < n:
        chosen += rng.sample(pool, len(pool))
    return [_row(*q) for q in chosen[:n]]


BUILTIN_TASKS = {"arithmetic": arithmetic_rows}


def task_eval_metrics(name: str) -> dict:
    """Held-out metrics a built-in task grades besides the run's rewards: {name: reward-like function}.

    arithmetic: `accuracy_boxed`, only answers given in the instructed \\boxed{} count (what a
    MATH-style grader that reads the boxed answer alone would score).
    """
    from ..rewards.verifiable import boxed_math_reward

    return {"arithmetic": {"accuracy_boxed": boxed_math_reward}}.get(name, {})


def task_rows(spec: str, *, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows of a built-in task named ``"<task>"`` or ``"<task>:<n>"`` (e.g. ``"arithmetic:500"``)."""
    name, _, count = spec.partition(":")
    if name not in BUILTIN_TASKS:
        raise ValueError(f"task {spec!r}: expected one of {sorted(BUILTIN_TASKS)}")
    if count and not count.isdigit():
        raise ValueError(f"task {spec!r}: expected '<task>:<number of rows>', got count {count!r}")
    return BUILTIN_TASKS[name](int(count) if count else None, seed=seed, split=split)

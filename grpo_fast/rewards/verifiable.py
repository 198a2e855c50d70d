"""Verifiable rewards: math answers checked with ``math-verify``, the ``\\boxed{}`` format, and
correctness with a DAPO-style soft penalty for overlong completions.

All follow TRL's reward-function signature::

    f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]

``completions`` are strings or lists of chat messages; every dataset column arrives as a list with
one entry per completion (``answer=[...]``). ``None`` means "no reward for this row" (TRL turns it
into NaN and ignores it). ``__name__`` names the function in metrics (``rewards/<name>/mean``).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading

from .extract import boxed_contents, completion_text, final_answer

logger = logging.getLogger(__name__)

# math-verify bounds each parse / comparison with signal.alarm, which only works in the main
# thread (elsewhere it raises ValueError). Off the main thread we run without its timeout; so we do
# when a real-time alarm is already pending (e.g. pytest-timeout's), which alarm() would cancel.
_MATH_VERIFY_TIMEOUT_S = 3
# Answers are short; a longer "answer" is wrong anyway and can make sympy's parser crawl (100 nested
# parentheses took 1.5 s to hit the timeout), so it is scored 0 without parsing.
MAX_ANSWER_CHARS = 200


class _NoDisabledTimeoutNotice(logging.Filter):
    """math-verify warns at every call without a timeout; off the main thread (the vLLM engine's groups are
    scored in a worker thread while it decodes) that is by design here: MAX_ANSWER_CHARS bounds a parse, and
    `reward_timeout` a whole call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoDisabledTimeoutNotice())


def _timeout_s() -> int | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    if hasattr(signal, "getitimer") and signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return _MATH_VERIFY_TIMEOUT_S


def _as_boxed(answer: str) -> str:
    """Wrap an answer in ``\\boxed{}`` so math-verify parses exactly it (LaTeX or plain number)."""
    answer = answer.strip()
    if "\\boxed" in answer:
        return answer
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return "\\boxed{" + answer + "}"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int | None):
    from math_verify import parse

    return parse(_as_boxed(gold), parsing_timeout=timeout_s)


def is_correct(text: str, gold) -> bool:
    """True if the final answer of ``text`` equals ``gold`` (number or LaTeX) under math-verify.

    Never raises: a parse error, a timeout, unparsable text or an answer longer than
    ``MAX_ANSWER_CHARS`` count as wrong.
    """
    pred = final_answer(text)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException  # a BaseException, so named explicitly

    try:
        timeout_s = _timeout_s()
        gold_parsed = _parse_gold(str(gold), timeout_s)
        pred_parsed = parse(_as_boxed(pred), parsing_timeout=timeout_s)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    except (Exception, TimeoutException):
        logger.debug("math-verify failed on %r vs %r", pred, gold, exc_info=True)
        return False


def _column(name: str, values, n: int) -> list:
    """Check a dataset column arrived as one entry per completion."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"reward column {name!r}: expected a list with one entry per completion, got {type(values).__name__}"
        )
    if len(values) != n:
        raise ValueError(f"reward column {name!r}: expected {n} entries (one per completion), got {len(values)}")
    return list(values)


def math_reward(prompts=None, completions=None, completion_ids=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer (last ``\\boxed{}``, else last number) equals ``answer``.

    Returns None for every row when there is no ``answer`` column, and for rows whose answer is None.
    """
    completions = list(completions or [])
    if answer is None:
        return [None] * len(completions)
    answer = _column("answer", answer, len(completions))
    return [
        None if gold is None else float(is_correct(completion_text(c), gold))
        for c, gold in zip(completions, answer, strict=True)
    ]


math_reward.__name__ = "math"
math_reward.required_columns = ("answer",)  # the trainer checks the dataset has them before the first step


def boxed_math_reward(prompts=None, completions=None, completion_ids=None, answer=None, **kwargs) -> list[float | None]:
    """Strict grading: 1.0 only when the answer is given in the instructed ``\\boxed{}`` and is right.

    `math_reward` also accepts a bare final number; this one is what a MATH-style grader that reads
    only the boxed answer would score. None as in `math_reward`.
    """
    lenient = math_reward(prompts, completions, completion_ids, answer)
    boxed = format_reward(prompts, completions, completion_ids)
    return [None if r is None else r * b for r, b in zip(lenient, boxed, strict=True)]


boxed_math_reward.__name__ = "math_boxed"
boxed_math_reward.required_columns = ("answer",)


def format_reward(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
    """1.0 when the completion holds exactly one ``\\boxed{...}`` and its content is not blank."""
    out = []
    for c in completions or []:
        boxed = boxed_contents(completion_text(c))
        out.append(float(len(boxed) == 1 and boxed[0] is not None and boxed[0].strip() != ""))
    return out


format_reward.__name__ = "format"


def overlong_penalty(length: int, max_completion_length: int, buffer: int) -> float:
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13), in [-1, 0].

    With ``L = length``, ``L_max = max_completion_length`` and ``B = buffer``::

        0                        if L <= L_max - B
        (L_max - B - L) / B      if L_max - B < L <= L_max     (linear from 0 down to -1)
        -1                       if L > L_max
    """
    if length <= max_completion_length - buffer:
        return 0.0
    if length <= max_completion_length:
        return (max_completion_length - buffer - length) / buffer
    return -1.0


class LengthAwareMathReward:
    """Math correctness plus DAPO's soft overlong penalty: ``reward = correct + overlong_penalty``.

    ``correct`` is :func:`math_reward` (0 or 1) and the penalty (see :func:`overlong_penalty`)
    depends on the completion's token count ``len(completion_ids[i])``, so a right answer in a
    completion that ran into the last ``buffer`` tokens before ``max_completion_length`` earns
    between 1 and 0, and a wrong one between 0 and -1. Rows without an answer get None.

    Args:
        max_completion_length: the generation limit ``L_max`` in tokens.
        buffer: the length ``B`` of the penalty ramp in tokens, 1 <= B <= L_max
            (default ``L_max // 4``; DAPO used 4096 of 20480).
    """

    __name__ = "math_length"
    required_columns = ("answer",)

    def __init__(self, max_completion_length: int, buffer: int | None = None):
        if not isinstance(max_completion_length, int) or max_completion_length < 1:
            raise ValueError(f"max_completion_length: expected a positive int, got {max_completion_length!r}")
        if buffer is None:
            buffer = max(1, max_completion_length // 4)
        if not isinstance(buffer, int) or not 1 <= buffer <= max_completion_length:
            raise ValueError(
                f"buffer: expected an int in [1, max_completion_length={max_completion_length}], got {buffer!r}"
            )
        self.max_completion_length = max_completion_length
        self.buffer = buffer

    def __repr__(self) -> str:
        return f"LengthAwareMathReward(max_completion_length={self.max_completion_length}, buffer={self.buffer})"

    def __call__(self, prompts=None, completions=None, completion_ids=None, answer=None, **kwargs):
        completions = list(completions or [])
        if completion_ids is None:
            raise ValueError("math_length reward: needs completion_ids (token ids per completion) to measure lengths")
        completion_ids = _column("completion_ids", completion_ids, len(completions))
        correct = math_reward(prompts, completions, completion_ids, answer=answer)
        return [
            None if c is None else c + overlong_penalty(len(ids), self.max_completion_length, self.buffer)
            for c, ids in zip(correct, completion_ids, strict=True)
        ]


class LeadReward:
    """GRPO-LEAD's length-dependent accuracy reward (`objective.lead_length_rewards`): math-verify
    correctness, then a correct answer earns ``exp(-lead_alpha * z)`` with ``z`` its token length's
    z-score among the correct answers of its group, a wrong one ``lead_wrong_reward``; so, within a
    group, shorter right answers earn more and every right answer more than a wrong one.

    A group is a run of consecutive completions of the same prompt, at most ``num_generations`` long
    (the trainer's groups, also when one prompt's groups follow each other; a single held-out
    completion is a group of one and earns 1 when right). Its first-reward value is > 0
    exactly when the answer is right, so ``eval/accuracy`` stays the share of right answers.
    """

    __name__ = "lead"
    required_columns = ("answer",)

    def __init__(self, lead_alpha: float = 0.05, lead_wrong_reward: float = -1.0, num_generations: int | None = None):
        if not (isinstance(lead_alpha, (int, float)) and lead_alpha >= 0):
            raise ValueError(f"lead_alpha: expected a number >= 0, got {lead_alpha!r}")
        if num_generations is not None and not (isinstance(num_generations, int) and num_generations >= 1):
            raise ValueError(f"num_generations: expected None or an int >= 1, got {num_generations!r}")
        self.alpha, self.wrong_reward, self.group = float(lead_alpha), float(lead_wrong_reward), num_generations

    def __repr__(self) -> str:
        return f"LeadReward(lead_alpha={self.alpha}, lead_wrong_reward={self.wrong_reward}, num_generations={self.group})"

    def __call__(self, prompts=None, completions=None, completion_ids=None, answer=None, **kwargs):
        import torch

        from ..objective import lead_length_rewards

        completions = list(completions or [])
        if completion_ids is None:
            raise ValueError("lead reward: needs completion_ids (token ids per completion) to measure lengths")
        completion_ids = _column("completion_ids", completion_ids, len(completions))
        prompts = list(prompts) if prompts is not None else [None] * len(completions)
        correct = math_reward(prompts, completions, completion_ids, answer=answer)
        out: list[float | None] = []
        start = 0
        while start < len(completions):  # one run of equal prompts at a time
            end = start + 1
            while end < len(completions) and prompts[end] == prompts[start] and end - start != self.group:
                end += 1
            run = range(start, end)
            ok = torch.tensor([bool(correct[i]) for i in run])
            lengths = torch.tensor([float(len(completion_ids[i])) for i in run])
            shaped = lead_length_rewards(ok, lengths, len(run), alpha=self.alpha, wrong_reward=self.wrong_reward)
            out += [None if correct[i] is None else float(v) for i, v in zip(run, shaped, strict=True)]
            start = end
        return out

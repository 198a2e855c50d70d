"""Step judges: how much of a completion's reasoning is right, in [0, 1] (SGPO partial credit).

TRL's reward signature; the trainer calls a judge named by `partial_credit_judge` on the
completions of groups with no correct answer.
"""

from __future__ import annotations

import re

from .extract import completion_text

# The result of an equation: "= 12", "=12", "= -3", "= 1,024"
_RESULT = re.compile(r"=\s*(-?\d+(?:,\d{3})*(?:\.\d+)?)")


def chain_steps(prompts=None, completions=None, completion_ids=None, steps=None, **kwargs) -> list[float | None]:
    """The share of the expected intermediate results (the `steps` column, in order) that the
    completion's equations reach before the first wrong one: its k-th "= number" is compared with
    the k-th step, and the count stops at the first mismatch or missing equation. None for rows
    without steps."""
    completions = list(completions or [])
    if steps is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, steps, strict=True):
        if not expected:
            out.append(None)
            continue
        results = [r.replace(",", "") for r in _RESULT.findall(completion_text(completion))]
        right = 0
        for got, want in zip(results, expected, strict=False):  # fewer equations: the rest are missing
            if float(got) != float(want):
                break
            right += 1
        out.append(right / len(expected))
    return out


chain_steps.required_columns = ("steps",)

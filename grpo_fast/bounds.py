"""Numeric ranges declared on option fields: one check and one wording for every options object.

A field carries its range in its metadata (`metadata={"bounds": Bounds(...)}`, `options.option(...,
bounds=...)`); `GRPOConfig` and `LossOptions` each check all their fields' ranges in one loop, and the fields
an options record declares take their range from it (grpo_fast/options.py), so a range is declared once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Bounds:
    """low / high (None: unbounded), open or closed; finite: inf is refused too; text: the wording when
    the generated one would read worse; note: appended to it (why the range is what it is)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    integer: bool = False
    text: Optional[str] = None
    note: str = ""

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)) or math.isnan(value):
            return False
        if self.finite and not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, integer: bool = False) -> str:
        """'an integer >= 1', 'a number in (0, 1]', 'a positive finite number', 'a finite number >= 0', ..."""
        if self.text is not None:
            return self.text + self.note
        if (integer or self.integer) and self.low is not None and self.high is None:
            text = f"an integer {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.low is not None and self.high is not None:
            text = f"a number in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        elif self.low == 0 and self.low_open and self.finite:
            text = "a positive finite number"
        elif self.low is not None:
            text = f"a {'finite ' if self.finite else ''}number {'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            text = "a finite number" if self.finite else "a number"
        return text + self.note


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


INTEGER_AT_LEAST_1 = Bounds(low=1, integer=True)
INTEGER_AT_LEAST_0 = Bounds(low=0, integer=True)
FINITE_AT_LEAST_0 = Bounds(low=0, finite=True)
FINITE = Bounds(finite=True)
POSITIVE_FINITE = Bounds(low=0, low_open=True, finite=True)
FRACTION_OPEN_LOW = Bounds(low=0, high=1, low_open=True)  # (0, 1]

"""Pull the text and the final answer out of a completion.

A completion is a string, or (conversational data) a list of chat messages
``[{"role": "assistant", "content": "..."}]`` whose content may itself be a list of parts
``[{"type": "text", "text": "..."}]``. The answer is the content of the last ``\\boxed{...}``
(braces matched, so ``\\boxed{\\frac{1}{2}}`` works), else the last number in the text.
"""

from __future__ import annotations

import re

_BOXED = "\\boxed"
# A number: optional sign (only when it does not follow a word character, so the "-" of "5-3"
# stays an operator), digits with optional thousands commas, optional decimals.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:,\d{3})*(?:\.\d+)?")


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the joined contents of its messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):  # a single message
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        return "\n".join(_message_text(m) for m in completion)
    return "" if completion is None else str(completion)


def _message_text(message) -> str:
    if not isinstance(message, dict):
        return str(message)
    content = message.get("content", "")
    if isinstance(content, list):  # multimodal-style parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def boxed_contents(text: str) -> list[str | None]:
    """The content of every ``\\boxed`` in order; None for one without a balanced ``{...}``.

    ``\\boxed{a{b}c}`` gives ``"a{b}c"``; ``\\boxed 5`` and an unclosed ``\\boxed{5`` give None.
    """
    out: list[str | None] = []
    start = text.find(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        content = None
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        content = text[i + 1 : j]
                        break
                j += 1
        out.append(content)
        start = text.find(_BOXED, start + len(_BOXED))
    return out


def last_number(text: str) -> str | None:
    """The last number in the text, thousands commas removed ("1,000" -> "1000"); None if none."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def final_answer(text: str) -> str | None:
    """The completion's final answer: the last non-empty ``\\boxed{...}``, else the last number."""
    for content in reversed(boxed_contents(text)):
        if content is not None and content.strip():
            return content.strip()
    return last_number(text)

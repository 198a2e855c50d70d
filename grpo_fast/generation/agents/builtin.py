"""Built-in tools, by the names `--tools` takes (`calculator`), and resolving `--tools` entries.

`calculator` evaluates arithmetic by walking Python's syntax tree (numbers, + - * / // % **, unary
minus, parentheses): no `eval`, no names, no calls, and exponents and results kept small, so a model
cannot make it compute for minutes or allocate gigabytes.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from typing import Callable

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 1e30
_MAX_LENGTH = 200
_TYPESET = str.maketrans({"×": "*", "−": "-", "÷": "/"})  # (the tasks typeset their questions with these)


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError(f"unsupported syntax {type(node).__name__}: only numbers, + - * / // % ** and parentheses")
    if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
        raise ValueError("the result is too large or not a real number")
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression of numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_LENGTH:
        raise ValueError(f"the expression is longer than {_MAX_LENGTH} characters")
    expression = expression.translate(_TYPESET)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    elif isinstance(value, float):
        value = round(value, 6) if math.isfinite(value) else value
    return str(value)


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}


def resolve_tool(entry: str, what: str = "tools") -> Callable:
    """A `--tools` entry: a built-in name, or `module:function` (importable, e.g. a file on PYTHONPATH); `what`:
    the option named in errors (`--environment_factory module:Class` resolves the same way, built-ins aside)."""
    if what == "tools" and entry in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[entry]
    if ":" not in entry:
        known = f"neither a built-in tool {sorted(BUILTIN_TOOLS)} nor" if what == "tools" else "not"
        raise ValueError(f"{what}: {entry!r} is {known} module:name")
    module, _, name = entry.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{what}: cannot load {entry!r} ({type(err).__name__}: {err}); expected module:name"
                         f"{f' or a built-in name {sorted(BUILTIN_TOOLS)}' if what == 'tools' else ''}") from None
    return fn

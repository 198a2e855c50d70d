"""Tools: checked before any work (one line naming the tool and what is missing), run concurrently, each
bounded by its timeout; a raising or hanging tool becomes an error result and costs nothing else."""

import asyncio
import time

import pytest

from grpo_fast.generation.agents.builtin import calculator, resolve_tool
from grpo_fast.generation.agents.tools import ToolRunner, as_tools


def good(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


def no_hint(x):
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


def no_args_entry(x: int) -> int:
    """Double a number."""
    return 2 * x


def test_schema_from_type_hints_and_docstring():
    (tool,) = as_tools([good])
    assert tool.name == "good" and not tool.is_async
    assert tool.schema["function"]["parameters"]["properties"]["x"] == {"type": "integer", "description": "The number."}


@pytest.mark.parametrize("fn, words", [(no_hint, "type hint"), (no_args_entry, "Args:")])
def test_bad_tools_refused_naming_them(fn, words):
    with pytest.raises(ValueError, match=f"tool '{fn.__name__}'.*{words}"):
        as_tools([fn])


def test_two_tools_with_one_name_refused():
    def good(y: int) -> int:  # noqa: F811 (the clash is the point)
        """Another.

        Args:
            y: A number.
        """
        return y

    with pytest.raises(ValueError, match="two tools are named 'good'"):
        as_tools([globals()["good"], good])


def test_calls_run_concurrently_and_results_keep_call_order():
    def slow(s: float) -> str:
        """Sleep.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return f"slept {s}"

    async def aslow(s: float) -> str:
        """Sleep without blocking.

        Args:
            s: Seconds.
        """
        await asyncio.sleep(s)
        return f"awaited {s}"

    runner = ToolRunner(as_tools([slow, aslow]), timeout=10)
    start = time.monotonic()
    calls = runner.start([{"name": "slow", "arguments": {"s": 0.5}}, {"name": "aslow", "arguments": {"s": 0.5}},
                          {"name": "slow", "arguments": {"s": 0.5}}])
    assert time.monotonic() - start < 0.4, "start() returns at once"
    calls.wait()
    elapsed = time.monotonic() - start
    assert elapsed < 1.4, f"three 0.5 s calls took {elapsed:.2f} s: not concurrent"
    assert [r.content for r in calls.results(10)] == ["slept 0.5", "awaited 0.5", "slept 0.5"]


def test_raising_unknown_bad_arguments_and_hanging_tools_become_error_results():
    def boom(x: int) -> int:
        """Raise.

        Args:
            x: Ignored.
        """
        raise RuntimeError("tool exploded")

    def hang(x: int) -> int:
        """Never return (in practice).

        Args:
            x: Ignored.
        """
        time.sleep(600)
        return x

    runner = ToolRunner(as_tools([boom, hang, good]), timeout=1)
    start = time.monotonic()
    calls = runner.start([{"name": "boom", "arguments": {"x": 1}}, {"name": "hang", "arguments": {"x": 1}},
                          {"name": "nope", "arguments": {}}, {"name": "good", "arguments": {"z": 1}},
                          {"name": "good", "arguments": [1]}, {"name": "good", "arguments": {"x": 4}}])
    calls.wait()
    results = calls.results(1)
    assert time.monotonic() - start < 5, "a hanging tool is abandoned at tool_timeout"
    assert [r.failed for r in results] == [True, True, True, True, True, False]
    assert "tool exploded" in results[0].content and results[1].timed_out
    assert "no tool named 'nope'" in results[2].content and "TypeError" in results[3].content
    assert results[5].content == "8"


@pytest.mark.parametrize("expression, value", [("(3 + 4) * 2", "14"), ("7 / 2", "3.5"), ("2 ** 10", "1024"),
                                               ("-5 + 3", "-2"), ("10 // 3", "3"), ("10 % 4", "2")])
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('x')", "a + 1", "9 ** 9 ** 9", "1 / 0", "[1] * 9",
                                        "1e300 * 1e300", "'a' * 5"])
def test_calculator_refuses_what_is_not_small_arithmetic(expression):
    with pytest.raises((ValueError, OverflowError)):
        calculator(expression)


def test_tools_resolved_by_name():
    assert resolve_tool("calculator") is calculator
    assert resolve_tool("tests.agents.test_tools:good") is good
    with pytest.raises(ValueError, match="neither a built-in tool"):
        resolve_tool("abacus")

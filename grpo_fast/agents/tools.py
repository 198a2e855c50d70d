"""Tools an agent calls: checked once (`as_tools`), then run concurrently and bounded (`ToolRunner`).

A tool is a plain Python function, sync or `async def`, with a type hint on every argument and a
Google-style docstring with an `Args:` entry for each (transformers' `get_json_schema` turns it into
the JSON schema the chat template shows the model), as TRL's `GRPOTrainer(tools=...)` takes them.

Tool code is user code: it may raise, hang or never return. `ToolRunner.start` runs each call in a
daemon thread of its own (sync tools) or on one event loop in a daemon thread (async tools) and
returns at once; the caller polls `Calls.ready()` between engine steps. A call past its deadline is
abandoned into an error result: its thread holds no worker of anyone else's and, being a daemon,
does not delay the end of the process (a pool's executor would join it at exit).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Tool:
    """One checked tool: its name, the function, the JSON schema the chat template renders."""

    name: str
    fn: Callable
    schema: dict
    is_async: bool


def as_tool(fn: Callable, *, name: Optional[str] = None) -> Tool:
    """`fn` checked and described; a bad tool raises one line naming it and what is missing."""
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
        get_json_schema,
    )

    label = name or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise TypeError(f"tools: {label!r} is not callable; a tool is a function with type hints and an Args: docstring")
    try:
        schema = get_json_schema(fn)
    except TypeHintParsingException as err:
        raise ValueError(f"tools: tool {label!r} cannot be described to the model: {err} (every argument needs a "
                         f"type hint)") from None
    except DocstringParsingException as err:
        raise ValueError(f"tools: tool {label!r} cannot be described to the model: {err} (a Google-style docstring "
                         f"with a description and an Args: entry per argument)") from None
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    target = fn.__func__ if inspect.ismethod(fn) else fn
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema,
                is_async=inspect.iscoroutinefunction(target)
                or (not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)))


def as_tools(fns: Sequence[Callable]) -> list[Tool]:
    """Check every tool (`as_tool`) and that no two share a name."""
    if isinstance(fns, (str, bytes)) or not isinstance(fns, Sequence):
        raise TypeError(f"tools must be a list of functions, got {type(fns).__name__}")
    tools = [f if isinstance(f, Tool) else as_tool(f) for f in fns]
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise ValueError(f"tools: two tools are named {tool.name!r} (positions {seen[tool.name]} and {i}); the model "
                             f"calls a tool by its name, so names must be unique")
        seen[tool.name] = i
    return tools


@dataclass
class Result:
    """What one call returned, as the tool message's content, and how it went."""

    name: str
    content: str
    failed: bool = False  # raised, unknown tool, bad arguments, or timed out
    timed_out: bool = False


@dataclass
class _Call:
    name: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Optional[BaseException] = None
    future: Any = None  # an async call's, cancelled when abandoned


def _content(value) -> str:
    """A tool's return value as the tool message's text (TRL: str(result))."""
    return value if isinstance(value, str) else str(value)


class Calls:
    """The calls of one assistant turn, running; `ready()` when all returned or the deadline passed."""

    def __init__(self, calls: list[_Call], deadline: float, immediate: list[Optional[Result]]):
        self._calls, self._deadline, self._immediate = calls, deadline, immediate

    def ready(self) -> bool:
        return all(c.done.is_set() for c in self._calls) or time.monotonic() >= self._deadline

    def wait(self) -> None:
        """Block until ready."""
        for c in self._calls:
            c.done.wait(max(self._deadline - time.monotonic(), 0.0))

    def results(self, timeout: float) -> list[Result]:
        """One Result per call, in call order (call when ready: unfinished calls become timeout errors)."""
        out, running = [], iter(self._calls)
        for early in self._immediate:
            if early is not None:
                out.append(early)
                continue
            c = next(running)
            if not c.done.is_set():
                if c.future is not None:
                    c.future.cancel()  # (a sync call's thread cannot be stopped: it is a daemon, left to finish)
                out.append(Result(c.name, f"error: tool {c.name!r} did not return within tool_timeout={timeout:g} s",
                                  failed=True, timed_out=True))
            elif c.error is not None:
                out.append(Result(c.name, f"error: {type(c.error).__name__}: {c.error}", failed=True))
            else:
                out.append(Result(c.name, _content(c.result)))
        return out


class ToolRunner:
    """Runs parsed calls (`{"name": ..., "arguments": {...}}`) of the given tools, each bounded by `timeout` seconds."""

    def __init__(self, tools: Sequence[Tool], timeout: float):
        self.tools = {t.name: t for t in tools}
        self.timeout = float(timeout)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:  # one loop for every async tool, in a daemon thread (never joined)
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="grpo_fast-async-tools", daemon=True).start()
        return self._loop

    def start(self, calls: Sequence[dict], tools: Optional[dict] = None) -> Calls:
        """Start every call now and return at once. `tools`: this trajectory's tools by name (an environment's
        bound methods), else the runner's."""
        tools = self.tools if tools is None else tools
        running, immediate = [], []
        for call in calls:
            name, args = call.get("name"), call.get("arguments", {})
            tool = tools.get(name) if isinstance(name, str) else None
            if tool is None:
                immediate.append(Result(str(name), f"error: no tool named {name!r}; the tools are {sorted(tools)}",
                                        failed=True))
                continue
            if not isinstance(args, dict):
                immediate.append(Result(name, f"error: the arguments of {name!r} must be a JSON object, got "
                                              f"{type(args).__name__}", failed=True))
                continue
            immediate.append(None)
            running.append(self._launch(tool, args))
        return Calls(running, time.monotonic() + self.timeout, immediate)

    def _launch(self, tool: Tool, args: dict) -> _Call:
        c = _Call(tool.name)

        def finish(result=None, error=None):
            c.result, c.error = result, error
            c.done.set()

        if tool.is_async:
            async def run():
                try:
                    finish(await tool.fn(**args))
                except BaseException as err:  # noqa: BLE001 (a tool's failure is its result)
                    finish(error=err)

            c.future = asyncio.run_coroutine_threadsafe(run(), self._event_loop())
        else:
            def run():
                try:
                    finish(tool.fn(**args))
                except BaseException as err:  # noqa: BLE001
                    finish(error=err)

            threading.Thread(target=run, name=f"grpo_fast-tool-{tool.name}", daemon=True).start()
        return c

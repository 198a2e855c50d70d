"""Tools an agent calls: checked once (`as_tools`), then run concurrently and bounded (`ToolRunner`).

A tool is a plain Python function, sync or `async def`, with a type hint on every argument and a
Google-style docstring with an `Args:` entry for each (transformers' `get_json_schema` turns it into
the JSON schema the chat template shows the model), as TRL's `GRPOTrainer(tools=...)` takes them.

Tool code is user code: it may raise, hang, never return, or return something whose `str()` raises.
`ToolRunner.start` runs each call in a daemon thread of its own (sync tools) or on one event loop in a
daemon thread (async tools), or with `tool_isolation='process'` in a worker process (isolation.py), and
returns at once; the caller polls `Calls.ready()` between engine steps. A call past its deadline is
abandoned into an error result: its thread holds no worker of anyone else's and, being a daemon,
does not delay the end of the process (a pool's executor would join it at exit). The result becomes text
where the tool ran (`result_text`: str(), cut to a character bound, lone surrogates replaced), so
whatever goes wrong there is that call's failure. A turn runs at most `max_calls` calls; the rest are
answered with an error without running (a turn of 500 calls would start 500 threads).

A sync tool's thread waits, after handing its result over, for the child processes the tool started and
left: they would otherwise stay zombies of the trainer. Only that thread's own children are waited for
(Linux lists a process's children per thread that started them), never those of the sandbox, the engine
or another tool. A tool that keeps a child running across calls and polls it later then finds it already
reaped (`Popen.poll` reads 0). (Async tools share the event loop's thread: asyncio waits for the processes
it starts itself.)
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .isolation import ToolFailed, WorkerPool, children_of_this_thread, result_text, wait_for


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
    result: Any = None  # its text (result_text)
    error: Optional[BaseException] = None
    future: Any = None  # an async call's, cancelled when abandoned


def _error_text(err: BaseException) -> str:
    """The error result of a call that raised `err` (whose own str() may raise too)."""
    if isinstance(err, ToolFailed):
        return f"error: {err}"
    try:
        return result_text(f"error: {type(err).__name__}: {err}")
    except Exception:  # noqa: BLE001
        return f"error: {type(err).__name__}"


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
                out.append(Result(c.name, _error_text(c.error), failed=True))
            else:
                out.append(Result(c.name, c.result))
        return out


ISOLATIONS = ("thread", "process")


class ToolRunner:
    """Runs parsed calls (`{"name": ..., "arguments": {...}}`) of the given tools, each bounded by `timeout` seconds.

    isolation: "thread" (in this process) or "process" (the given tools in worker processes; a trajectory's
    environment methods, which act on an instance in this process, still run in threads); max_chars: results
    cut to this many characters where the tool ran; max_calls: most calls run per turn (None: all)."""

    def __init__(self, tools: Sequence[Tool], timeout: float, *, isolation: str = "thread",
                 max_chars: Optional[int] = None, max_calls: Optional[int] = None):
        if isolation not in ISOLATIONS:
            raise ValueError(f"tool_isolation={isolation!r} is invalid: expected one of {list(ISOLATIONS)}")
        self.tools = {t.name: t for t in tools}
        self.timeout = float(timeout)
        self.max_chars, self.max_calls, self.isolation = max_chars, max_calls, isolation
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._isolated = {id(t) for t in tools} if isolation == "process" else set()
        for t in tools if isolation == "process" else ():
            _check_sendable(t)
        self.workers = WorkerPool() if isolation == "process" else None

    def close(self) -> None:
        """End the idle worker processes (tool_isolation='process'); a later call starts new ones."""
        if self.workers is not None:
            self.workers.close()

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
        for k, call in enumerate(calls):
            name, args = call.get("name"), call.get("arguments", {})
            tool = tools.get(name) if isinstance(name, str) else None
            if self.max_calls is not None and k >= self.max_calls:
                immediate.append(Result(str(name), f"error: call {k + 1} of {len(calls)} in one turn was not run: at "
                                                   f"most max_tool_calls_per_turn={self.max_calls} run", failed=True))
                continue
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

        if id(tool) in self._isolated:
            deadline = time.monotonic() + self.timeout

            def run():
                try:
                    text = self.workers.call(tool.fn, args, self.max_chars, deadline)
                except BaseException as err:  # noqa: BLE001 (raised, or its worker died)
                    finish(error=err)
                    return
                if text is not None:  # (None: past its deadline, its worker killed: `results` says so)
                    finish(text)

            threading.Thread(target=run, name=f"grpo_fast-tool-{tool.name}", daemon=True).start()
        elif tool.is_async:
            async def run():
                try:
                    finish(result_text(await tool.fn(**args), self.max_chars))
                except BaseException as err:  # noqa: BLE001 (a tool's failure is its result)
                    finish(error=err)

            c.future = asyncio.run_coroutine_threadsafe(run(), self._event_loop())
        else:
            def run():
                try:
                    finish(result_text(tool.fn(**args), self.max_chars))
                except BaseException as err:  # noqa: BLE001
                    finish(error=err)
                wait_for(children_of_this_thread())  # (after the result is handed over: the tool's leftovers)

            threading.Thread(target=run, name=f"grpo_fast-tool-{tool.name}", daemon=True).start()
        return c


def _check_sendable(tool: Tool) -> None:
    """tool_isolation='process': the function must reach a worker by reference (a module-level function of an
    importable module); refused before any work, naming it."""
    import pickle

    where = getattr(tool.fn, "__module__", None)
    try:
        if where == "__main__":
            raise pickle.PicklingError("it is defined in the script being run (__main__), which a worker cannot import")
        pickle.dumps(tool.fn)
    except Exception as err:  # noqa: BLE001 (pickle raises several kinds)
        raise ValueError(f"tool_isolation='process': tool {tool.name!r} cannot be sent to a worker process ({err}); "
                         f"give a function defined at the top level of an importable module") from None

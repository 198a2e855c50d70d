"""Code as a verifiable reward: the program a completion holds, run against unit tests in the sandbox.

`code_tests` (`CodeTests`, async, TRL's signature) reads HumanEval's columns, `test` (a program defining
`check(candidate)`) and `entry_point`, and optionally `tests` (a list of assert statements, MBPP-style).
The program is the last fenced Python block when it defines `entry_point`, else prompt + completion
(HumanEval's completion format). `mode`:
- `all`: 1.0 when every test passes, else 0.0 (so `eval/accuracy` is pass@1);
- `share`: the share of tests that pass: the `tests` items, or the top-level asserts of `check()`, each run on
  its own.
A completion without code, a syntax error or a limit hit scores 0 and is counted (`code/no_code`,
`code/syntax_errors`, and the sandbox's `sandbox/*` counters); none of them stops the step.

Success is read from a line the harness prints after the tests, tagged with a fresh random token that it reads
from stdin before the model's code runs (in a namespace of its own, so rebinding exec, print or len there
changes nothing the harness uses). A program that ends early with exit status 0, or prints a made-up line,
does not pass. Not defended: a program that walks up to the harness's frame (sys._getframe) to read the
token, or a returned object whose __eq__ always says True; the sandbox bounds what a program can do, not
what it can claim.
"""

from __future__ import annotations

import ast
import asyncio
import re
import secrets
import threading
from typing import Optional

from ..sandbox import Sandbox, SandboxOptions

MODES = ("all", "share")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S)
_SANDBOXES: dict = {}  # SandboxOptions -> Sandbox: reward functions with the same limits share one pool


def sandbox_for(options: SandboxOptions) -> Sandbox:
    if options not in _SANDBOXES:
        _SANDBOXES[options] = Sandbox(options)
    return _SANDBOXES[options]


def program_of(prompt, completion, entry_point: Optional[str]) -> Optional[str]:
    """The program a completion holds (None: no code at all)."""
    text = completion[-1].get("content", "") if isinstance(completion, list) else str(completion)
    blocks = _FENCE.findall(text)
    if blocks and (entry_point is None or re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", blocks[-1])):
        return blocks[-1]
    if not text.strip():
        return None
    head = prompt[-1].get("content", "") if isinstance(prompt, list) else str(prompt)
    return head + text


def check_asserts(test: str) -> list[str]:
    """The top-level assert statements of `def check(candidate)` in a HumanEval test program, as source."""
    tree = ast.parse(test)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            return [ast.get_source_segment(test, stmt) for stmt in node.body if isinstance(stmt, ast.Assert)]
    return []


_HARNESS = """\
def _harness(program, test, entry_point, items, mode):
    import sys
    token, write = sys.stdin.readline().strip(), sys.__stdout__.write  # before the model's code runs
    sys.stdin.close()
    space = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(program, "<completion>", "exec"), space)  # the model's code, in a namespace of its own
    if test:
        exec(compile(test, "<test>", "exec"), space)
    passed = 0
    if mode == "share":
        space["candidate"] = space.get(entry_point)
        for source in items:
            try:
                exec(compile(source, "<assert>", "exec"), space)
                passed += 1
            except BaseException:
                pass
    else:
        if test:
            space["check"](space[entry_point])
        for source in items:
            exec(compile(source, "<assert>", "exec"), space)
        passed, items = 1, [None]
    sys.stdout.flush()
    write("\\n" + token + " " + str(passed) + " " + str(len(items)) + "\\n")
    sys.__stdout__.flush()


_harness({args})
"""


def harness(program: str, *, test: Optional[str], entry_point: Optional[str], tests: Optional[list], mode: str) -> str:
    """The program to run: the model's code and its tests, as data for a harness that runs them in a namespace of
    their own and prints the result line, tagged with the token it reads from stdin first (so the token is in
    neither the source nor the model's namespace)."""
    items = list(tests) if tests else (check_asserts(test) if mode == "share" and test else [])
    if mode == "share" and not items and test:
        items = []  # (a check() without top-level asserts: share mode scores it as all does)
    args = ", ".join(repr(x) for x in (program, test, entry_point, items, mode if items else "all"))
    return _HARNESS.replace("{args}", args)


class CodeTests:
    """code_tests: the share (or all) of a completion's unit tests that pass, run in the sandbox."""

    __name__ = "code_tests"

    def __init__(self, sandbox: Optional[SandboxOptions] = None, code_reward_mode: str = "all"):
        if code_reward_mode not in MODES:
            raise ValueError(f"code_reward_mode must be one of {list(MODES)}, got {code_reward_mode!r}")
        self.mode = code_reward_mode
        self.sandbox = sandbox_for(sandbox or SandboxOptions())
        self.counters = self  # (the score stage logs `metrics()` of every reward function's counters)
        self._lock, self._counts = threading.Lock(), {"no_code": 0, "syntax_errors": 0}

    async def __call__(self, prompts, completions, test=None, entry_point=None, tests=None, **columns) -> list[float]:
        n = len(completions)
        if test is None and tests is None:
            raise ValueError("code_tests reads the columns test and entry_point (HumanEval) or tests (a list of "
                             "assert statements); the dataset has neither")
        test, entry_point, tests = (col if col is not None else [None] * n for col in (test, entry_point, tests))
        return list(await asyncio.gather(*(self.one(p, c, t, e, ts) for p, c, t, e, ts in
                                           zip(prompts, completions, test, entry_point, tests, strict=True))))

    async def one(self, prompt, completion, test, entry_point, tests) -> float:
        program = program_of(prompt, completion, entry_point)
        if program is None:
            return self._count("no_code")
        try:
            compile(program, "<completion>", "exec")
        except Exception:  # (SyntaxError; RecursionError or MemoryError on a pathological one)
            return self._count("syntax_errors")
        token = secrets.token_hex(16)
        result = await self.sandbox.run_async(harness(program, test=test, entry_point=entry_point, tests=tests,
                                                      mode=self.mode), stdin=token + "\n")
        for line in reversed(result.stdout.splitlines()):
            parts = line.split()
            if len(parts) == 3 and parts[0] == token:
                passed, total = int(parts[1]), int(parts[2])
                return passed / total if total else 0.0
        return 0.0

    def _count(self, what: str) -> float:
        with self._lock:
            self._counts[what] += 1
        return 0.0

    def metrics(self) -> dict:
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {**self.sandbox.metrics(), **{f"code/{k}": v for k, v in counts.items()}}


def python_tool(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: a complete Python program; its standard output (and the end of its error output, if it failed)
            is returned, at most the sandbox's output limit.
    """
    result = sandbox_for(SandboxOptions()).run(code)
    text = result.stdout
    if result.reason != "exited" or result.exit_code != 0:
        text += f"\n[{result.reason}, exit status {result.exit_code}]\n{result.stderr[-2000:]}"
    return text

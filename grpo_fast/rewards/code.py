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

How a result is trusted (`code_harness.py`, the sandbox's main program): the model's program never shares a
process with the tests. A trusted harness process makes itself non-dumpable, reads a fresh key and the job
(program, prompt, tests) from stdin and empties stdin, and only then starts the program in a fresh interpreter
of its own. It runs the tests itself, calling the program's functions through proxies that accept only plain
data back (None, bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset; a failed call raises
the builtin exception the program raised, by name; a module the program imported is the harness's own import
of it, installed modules only), and prints the verdict with an HMAC under the key, which the trainer checks.
So rebinding builtins (exec, compile, str, len, print, __import__, AssertionError), poisoning sys.modules,
patching unittest, exiting early (sys.exit, os._exit, atexit), printing a made-up verdict, killing the
harness, walking frames for the key, reading /proc/1/fd/0 or /tmp/main.py (the harness's own text: no test is
in it) and an object whose __eq__ always says True all score 0 (tests/sandbox/test_reward_hacking.py). A name the prompt defines (HumanEval/38's encode_cyclic) is the
prompt's in the tests, not the program's; a program's function named after a builtin is not bound.

What this costs correct programs (each scores 0): a test that reads an argument the function changed in place,
one that builds an instance of the program's class or calls a method on it, one that passes a lambda or any
other non-plain value to the program, one that expects an exception class that is not a builtin (or a
StopIteration: replayed as RuntimeError, since a test's loop would read it as its end). The program has one
process less of `max_processes` (the harness's). What stays undefended: kernel bugs (the sandbox shares the
host's kernel); a program that is right on the tested inputs only (the tests are what they are); with
--unsafe_code_execution, everything (the program runs as the trainer's user).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import hmac
import json
import re
import secrets
import threading
import warnings
from pathlib import Path
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


HARNESS = (Path(__file__).parent / "code_harness.py").read_text(encoding="utf-8")  # the sandbox's main program


@functools.lru_cache(maxsize=4096)
def prompt_code(prompt: str) -> tuple[Optional[str], tuple[str, ...]]:
    """(the prompt, when it is Python that defines something, else None; the names it leaves for the program to
    write: functions whose body is a docstring, `pass` or `...`). The harness runs the prompt before the tests,
    so the helpers the tests call (HumanEval/38's encode_cyclic) are the dataset's, not the program's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (invalid escapes in prose)
            tree = ast.parse(prompt)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, ()
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    stub = lambda n: all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                         for s in n.body)  # (a docstring, `pass`, `...`)
    return (prompt, tuple(n.name for n in defs if stub(n))) if defs else (None, ())


def job(program: str, *, prompt: str, test: Optional[str], entry_point: Optional[str], tests: Optional[list],
        mode: str) -> dict:
    """What the harness runs: the program, the prompt's code and its stubs, the test program, and the items (the
    `tests` list, or in share mode check()'s top-level asserts, each scored on its own)."""
    items = list(tests) if tests else (check_asserts(test) if mode == "share" and test else [])
    code, stubs = prompt_code(prompt)
    return {"program": program, "prompt": code, "stubs": list(stubs), "test": test, "entry_point": entry_point,
            "items": items, "mode": mode if items else "all"}  # (a check() without top-level asserts: share scores it as all does)


def _mac(key: str, line: str) -> str:
    return hmac.new(key.encode(), line.encode(), "sha256").hexdigest()


def verdict(stdout: str, key: str) -> float:
    """The share of tests passed, from the last line "passed total mac" whose HMAC under `key` holds; 0.0 without
    one (the harness never got to print it, or something else printed)."""
    for line in reversed(stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and all(re.fullmatch(r"[0-9]{1,9}", p) for p in parts[:2]):
            passed, total = int(parts[0]), int(parts[1])
            if hmac.compare_digest(parts[2].encode(), _mac(key, f"{passed} {total}").encode()):
                return passed / total if 0 < total and passed <= total else 0.0
    return 0.0


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

    @staticmethod
    def missing_columns(have) -> str:
        """What a dataset with the columns `have` lacks for this reward, as the trainer's check of reward columns
        says it before any work ("" when nothing): test and entry_point, or tests."""
        if "tests" in have or {"test", "entry_point"} <= set(have):
            return ""
        lacking = [c for c in ("test", "entry_point") if c not in have]
        return f"the columns {lacking} (HumanEval's test program and the function it tests) or ['tests'] (assert statements)"

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
        head = prompt[-1].get("content", "") if isinstance(prompt, list) else str(prompt)
        work = job(program, prompt=head, test=test, entry_point=entry_point, tests=tests, mode=self.mode)
        key = secrets.token_hex(32)  # (read by the harness from stdin, which it then empties)
        result = await self.sandbox.run_async(HARNESS, stdin=key + "\n" + json.dumps(work))
        return verdict(result.stdout, key)

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

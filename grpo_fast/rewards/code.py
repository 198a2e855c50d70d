"""Code as a verifiable reward: the program a completion holds, run against unit tests in the sandbox.

`code_tests` (`CodeTests`, async, TRL's signature) reads HumanEval's columns, `test` (a program defining
`check(candidate)`) and `entry_point`, and optionally `tests` (a list of assert statements, MBPP-style).
The program is the last fenced Python block when it defines `entry_point`, else prompt + completion
(HumanEval's completion format). `mode`:
- `all`: 1.0 when every test passes, else 0.0 (so `eval/accuracy` is pass@1);
- `share`: the share of tests that pass: the `tests` items each on its own, or the top-level asserts of
  `check()`, each run as check(candidate) with the other top-level asserts removed (every other statement kept:
  the locals an assert reads are the test's, never the program's).
An item that tests nothing of the program is dropped (HumanEval's `assert True, "..."`; an assert on the test's
own values or on the prompt's helper): it reads neither the entry point, check()'s `candidate`, a prompt stub,
nor a name only the program can supply, directly or through a name the test or the prompt computes from one
(`test_plan`). A test with nothing left scores 0 in both modes.
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
in it) and an object whose __eq__ always says True all score 0 (tests/sandbox/test_reward_hacking.py).

Which names are the program's (`prompt_code`, `test_plan`): the prompt's code is the prompt when it is Python as
a whole (HumanEval's), else its fenced Python blocks, from every message of a chat prompt but the assistant's.
Its definitions (top-level def, class, import, assignment; not its example calls) run in the harness before the
tests, and in the program's process before the program (which may call them). A name they define with a real
body (HumanEval/32's poly, /38's encode_cyclic) is the prompt's in the tests, never the program's; its stubs
(a body of docstring, `pass`, `...` or `raise NotImplementedError`) and the entry point are the program's. Of the program's other names only
its functions (and modules, as the harness's own import) that the tests or the prompt's definitions read are
bound, never one the test binds, a builtin's name, or the program's data.

What this costs correct programs (each scores 0): a test that reads an argument the function changed in place,
one that builds an instance of the program's class or calls a method on it, one that passes a lambda or any
other non-plain value to the program, one that expects an exception class that is not a builtin (or a
StopIteration: replayed as RuntimeError, since a test's loop would read it as its end), one that reads a
constant of the program's (its data is never bound). In share mode a statement of check() that is not an assert
(a loop of asserts included) runs in every item, so where it fails every item fails. The program has one
process less of `max_processes` (the harness's). What stays undefended: kernel bugs (the sandbox shares the
host's kernel); a program that is right on the tested inputs only (the tests are what they are); with
--unsafe_code_execution, everything (the program runs as the trainer's user).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import copy
import functools
import hmac
import json
import re
import secrets
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Optional

from .sandbox import Sandbox, SandboxOptions

MODES = ("all", "share")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S)
_SANDBOXES: dict = {}  # SandboxOptions -> Sandbox: reward functions with the same limits share one pool


def sandbox_for(options: SandboxOptions) -> Sandbox:
    if options not in _SANDBOXES:
        _SANDBOXES[options] = Sandbox(options)
    return _SANDBOXES[options]


def _text(message) -> str:
    """A message's text: its content, or the text parts of a content list; a plain prompt as is."""
    content = message.get("content", "") if isinstance(message, dict) else message
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def program_of(prompt, completion, entry_point: Optional[str]) -> Optional[str]:
    """The program a completion holds (None: no code at all)."""
    text = _text(completion[-1]) if isinstance(completion, list) else str(completion)
    blocks = _FENCE.findall(text)
    if blocks and (entry_point is None or re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", blocks[-1])):
        return blocks[-1]
    if not text.strip():
        return None
    head = _text(prompt[-1]) if isinstance(prompt, list) else str(prompt)
    return head + text


def check_asserts(test: str) -> list[str]:
    """The top-level assert statements of `def check(candidate)` in a HumanEval test program, as source."""
    tree = ast.parse(test)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            return [ast.get_source_segment(test, stmt) for stmt in node.body if isinstance(stmt, ast.Assert)]
    return []


HARNESS = (Path(__file__).parent / "code_harness.py").read_text(encoding="utf-8")  # the sandbox's main program
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)
BUILTINS = frozenset(vars(builtins))


def _parse(source: str) -> Optional[ast.Module]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (invalid escapes in prose)
            return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _names(node) -> tuple[set, set]:
    """(the names `node` reads, the names it binds), all scopes inside it taken together."""
    reads, binds = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (reads if isinstance(n.ctx, ast.Load) else binds).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(n.name)
        elif isinstance(n, ast.arg):
            binds.add(n.arg)
        elif isinstance(n, ast.alias):
            binds.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name:
            binds.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            binds.add(n.rest)
    return reads, binds


def _defined(node) -> set:
    """The module-level names a definition binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names} - {"*"}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _placeholder(stmt) -> bool:
    """A statement of a stub's body: a docstring or other constant, `pass`, `...`, `raise NotImplementedError`."""
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return isinstance(stmt, ast.Pass) or isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _segment(source: str, node) -> str:
    decorators = "".join(f"@{ast.get_source_segment(source, d)}\n" for d in getattr(node, "decorator_list", ()))
    return decorators + ast.get_source_segment(source, node)


def prompt_texts(prompt) -> tuple[str, ...]:
    """The texts whose code is the prompt's: a plain prompt; of a chat prompt, every message but the assistant's
    (the system's helpers count; a prefilled assistant turn is the program's)."""
    if isinstance(prompt, list):
        return tuple(_text(m) for m in prompt if not (isinstance(m, dict) and m.get("role") == "assistant"))
    return (str(prompt),)


@functools.lru_cache(maxsize=4096)
def prompt_code(texts: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset, frozenset, tuple[tuple[frozenset, frozenset], ...]]:
    """(the prompt's definitions, as source; the names it leaves for the program to write: functions and classes
    whose body is only a docstring, `pass`, `...` or `raise NotImplementedError`; the names it defines with a real body, an assignment or an
    import; each definition's (names it reads of others, names it defines)). The code is a text that is Python as a whole (HumanEval's prompt),
    else its fenced Python blocks, each on its own. Definitions are the top-level def, class, import and
    assignment statements (a block's example calls and asserts are not run). The harness runs them before the
    tests (and the program's process before the program), so a helper the tests call (HumanEval/38's
    encode_cyclic) is the dataset's, not the program's redefinition."""
    definitions, stubs, owned, units = [], set(), set(), []
    for text in texts:
        whole = _parse(text)
        sources = [(text, whole)] if whole is not None else [(b, _parse(b)) for b in map(textwrap.dedent, _FENCE.findall(text))]
        for source, tree in sources:
            for node in tree.body if tree is not None else ():
                if not isinstance(node, DEFINITIONS) or isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                names = _defined(node)
                stub = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and all(map(_placeholder, node.body))
                (stubs if stub else owned).update(names)
                definitions.append(_segment(source, node))
                reads, binds = _names(node)
                units.append((frozenset(reads - binds), frozenset(names)))  # (what it reads of other names)
    return tuple(definitions), frozenset(stubs - owned), frozenset(owned), tuple(units)


@functools.lru_cache(maxsize=4096)
def test_plan(test: Optional[str], entry_point: Optional[str], tests: Optional[tuple], mode: str, stubs: frozenset,
              owned: frozenset, units: tuple) -> tuple[tuple, bool, tuple, bool]:
    """(the items, whether each is a check() to call, the program's names the tests need, whether anything of the
    program is tested at all).

    The names only the program supplies: the entry point, check()'s parameter, the prompt's stubs, and any name
    the tests read that neither they, the prompt nor the builtins define; then, to a fixed point, every name bound
    by a statement (of the prompt's definitions, of the test program, of check()'s body) that reads one of them.
    An item tests the program when it reads one; the others (HumanEval's `assert True, "..."`, an assert on the
    test's own values or on the prompt's helper) are dropped, and a test with nothing of the program in it scores
    0 (in all mode too). In share mode check()'s top-level asserts are the items, each run as check(candidate)
    with the other top-level asserts removed and every other statement kept: its locals are the test's."""
    tree = _parse(test) if test else None
    extra = [_parse(t) for t in tests or ()]
    reads, binds = set(), set()
    for node in [tree, *extra]:
        if node is not None:
            r, b = _names(node)
            reads, binds = reads | r, binds | b
    check = next((n for n in reversed(tree.body) if isinstance(n, ast.FunctionDef) and n.name == "check"), None) if tree else None
    param = check.args.args[0].arg if check is not None and check.args.args else "candidate"
    prompt_reads = set().union(*(r for r, _ in units))
    program = {param, entry_point, *stubs} | (reads | prompt_reads) - binds - owned - BUILTINS
    program.discard(None)
    steps = list(units) + [_names(n) for n in (tree.body if tree else ()) if n is not check]
    steps += [_names(n) for n in (check.body if check else ()) if not isinstance(n, ast.Assert)]
    grew = True
    while grew:
        grew = False
        for r, b in steps:
            if r & program and not b <= program:
                program |= b
                grew = True
    tested = lambda node: node is None or bool(_names(node)[0] & program)  # (an item that does not parse fails as it is)
    items = [t for t, node in zip(tests or (), extra, strict=True) if tested(node)]
    calls_check = False
    if not tests and mode == "share" and check is not None:
        for stmt in check.body:
            if isinstance(stmt, ast.Assert) and tested(stmt):
                one = copy.copy(check)
                one.body = [s for s in check.body if s is stmt or not isinstance(s, ast.Assert)]
                items.append(ast.unparse(one))
        calls_check = True
    something = bool(items) or check is not None and tested(check)
    needs = sorted(((reads | prompt_reads) - binds - owned - BUILTINS | stubs - binds) - {entry_point})
    return tuple(items), calls_check and bool(items), tuple(needs), something


def job(program: str, *, prompt, test: Optional[str], entry_point: Optional[str], tests: Optional[list],
        mode: str) -> Optional[dict]:
    """What the harness runs: the program, the prompt's definitions, the program's names the tests need, the test
    program, and the items (the `tests` list, or in share mode check()'s top-level asserts, each scored on its
    own); None when nothing of the program is tested."""
    definitions, stubs, owned, units = prompt_code(prompt_texts(prompt))
    owned = owned - {entry_point}  # (the entry point is the program's, even where the prompt gives it a body)
    items, calls_check, needs, something = test_plan(test, entry_point, tuple(tests) if tests else None, mode,
                                                      stubs, owned, units)
    if not something:
        return None
    return {"program": program, "prompt": list(definitions), "stubs": sorted(stubs), "needs": list(needs), "test": test,
            "entry_point": entry_point, "items": list(items), "calls_check": calls_check,
            "mode": mode if items else "all"}  # (a check() without top-level asserts: share scores it as all does)


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
        work = job(program, prompt=prompt, test=test, entry_point=entry_point, tests=tests, mode=self.mode)
        if work is None:  # (nothing of the program tested: no credit, and nothing to run)
            return 0.0
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

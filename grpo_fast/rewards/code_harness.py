"""The trusted side of `code_tests`: this file's text is the sandbox's main program (grpo_fast/rewards/code.py
sends it; it imports nothing of grpo_fast and runs on the system's python3). It runs as two processes.

- The harness (no argument) never runs model code. It makes itself non-dumpable first (then no other process
  of its uid may read its memory or descriptors through /proc, or trace it), reads the key and the job (the
  program, the prompt, the tests) from stdin and empties stdin (a memfd that the namespace's pid 1 also holds,
  and that /proc/1/fd/0 would reopen at offset 0). Only then does it start the candidate, a fresh interpreter,
  and send it the prompt's definitions and the program's text. It runs the prompt's definitions and the tests
  itself, in its own namespace, with the entry point and the program's functions the tests need (never a name
  the prompt defines, a builtin, or a name the test binds; never the program's data) bound to proxies that
  forward each call to the candidate and accept only plain data back. It prints one line, the verdict
  "passed total mac", whose HMAC under the key the trainer checks: no other process knows the key, so no other
  process can write a verdict.
- The candidate (`child REQUESTS REPLIES`) runs the prompt's definitions (so the program may call the prompt's
  helpers), execs the program and answers calls over two pipes. Everything in it is the program's to change;
  nothing the harness relies on lives there.

Values cross as JSON of tagged lists (`encode`, `decode`): None, bool, int, float, complex, str, bytes, tuple,
list, dict, set, frozenset, nested. The harness builds the exact builtin types from JSON's own types, so an
object whose __eq__ always says True, or any other object of the program's, cannot reach a test.
"""

import builtins
import ctypes
import hmac
import importlib
import json
import os
import subprocess
import sys
import traceback

PR_SET_DUMPABLE = 4
SHOWN_FAILURES = 8  # the candidate's first failing calls print their traceback (the sandbox reads why it stopped)
NOT_REPLAYED = ("StopIteration", "StopAsyncIteration")  # raised into a test, these would end a loop as if done


def encode(value):
    """A plain-data value as JSON-able tagged lists; TypeError for anything else. (In the candidate a subclass of
    a plain type is sent as its base type's value: the harness decodes into exact builtin types either way.)"""
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["?", bool(value)]
    if isinstance(value, int):
        return ["i", format(int(value), "x")]  # (hex: no limit on the digits of a power-of-two base)
    if isinstance(value, float):
        return ["f", float.hex(float(value))]  # (exact, inf and nan included)
    if isinstance(value, complex):
        return ["c", float.hex(value.real), float.hex(value.imag)]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["b", bytes(value).hex()]
    for kind, tag in ((tuple, "t"), (list, "l"), (frozenset, "F"), (set, "S")):
        if isinstance(value, kind):
            return [tag, [encode(item) for item in value]]
    if isinstance(value, dict):
        return ["d", [[encode(k), encode(v)] for k, v in value.items()]]
    raise TypeError(f"a {type(value).__name__} is not plain data (None, bool, int, float, complex, str, bytes, "
                    f"tuple, list, dict, set, frozenset)")


def decode(data):
    """The value `encode` made; ValueError (or TypeError, RecursionError) for anything else. Built from JSON's own
    types with the builtin constructors only: nothing of the sender's runs here."""
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError("malformed value")
    tag, args = data[0], data[1:]
    if tag == "n" and not args:
        return None
    if tag == "?" and len(args) == 1 and type(args[0]) is bool:
        return args[0]
    if tag in ("i", "f", "s", "b") and len(args) == 1 and type(args[0]) is str:
        return {"i": lambda s: int(s, 16), "f": float.fromhex, "s": str, "b": bytes.fromhex}[tag](args[0])
    if tag == "c" and len(args) == 2 and all(type(a) is str for a in args):
        return complex(float.fromhex(args[0]), float.fromhex(args[1]))
    if tag in ("t", "l", "F", "S") and len(args) == 1 and type(args[0]) is list:
        return {"t": tuple, "l": list, "F": frozenset, "S": set}[tag](decode(item) for item in args[0])
    if tag == "d" and len(args) == 1 and type(args[0]) is list:
        pairs = args[0]
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise ValueError("malformed dict")
        return {decode(k): decode(v) for k, v in pairs}
    raise ValueError(f"malformed value (tag {tag!r})")


# ---- the candidate: the program's own process


def candidate(requests_fd: int, replies_fd: int) -> None:
    requests = os.fdopen(requests_fd, "r", encoding="utf-8")
    replies = os.fdopen(replies_fd, "w", encoding="utf-8")
    shown = [0]

    def answer(message) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    def failure(err: BaseException) -> list:
        if shown[0] < SHOWN_FAILURES:  # (MemoryError, a fork's EAGAIN: the sandbox's counters read them)
            shown[0] += 1
            traceback.print_exc(limit=-3)
        try:
            return ["err", type(err).__name__, str(err)[:500]]
        except BaseException:
            return ["err", "RuntimeError", "an exception that cannot be shown"]

    space = {"__name__": "__main__", "__builtins__": builtins}
    prompt, program = json.loads(requests.readline())
    run_definitions(prompt, space)
    try:
        exec(compile(program, "<completion>", "exec"), space)
    except BaseException as err:  # (SystemExit included: a program that exits while loading did not load)
        answer(failure(err))
        return
    names = {}
    for name, value in list(space.items()):
        if isinstance(name, str) and not name.startswith("__"):
            if type(value).__name__ == "module":
                names[name] = ["m", getattr(value, "__name__", "")]
            elif callable(value):
                names[name] = ["f"]  # (its data is never sent: a test's values are the test's)
    answer(["ok", names])
    for line in requests:
        try:
            name, args, kwargs = json.loads(line)
            message = ["ok", encode(space[name](*decode(args), **decode(kwargs)))]
        except BaseException as err:
            message = failure(err)
        answer(message)


# ---- the harness: trusted, never runs model code


class CandidateProcess:
    """The candidate, started from the harness with the prompt's definitions and the program's text; `call`
    forwards one call."""

    def __init__(self, prompt: list, program: str, source: str):
        requests_r, self._requests_w = os.pipe()
        self._replies_r, replies_w = os.pipe()
        # a fresh interpreter (fork then exec), not a fork of this one: nothing of the harness's memory (the key,
        # the tests) is in it; stdin /dev/null (a program reading input() gets EOF, as it got a closed stdin)
        self.process = subprocess.Popen([sys.executable, "-I", "-c", source, "child", str(requests_r), str(replies_w)],
                                        stdin=subprocess.DEVNULL, pass_fds=(requests_r, replies_w), close_fds=True)
        os.close(requests_r)
        os.close(replies_w)
        self.requests = os.fdopen(self._requests_w, "w", encoding="utf-8")
        self.replies = os.fdopen(self._replies_r, "r", encoding="utf-8", errors="strict")
        self.ended, self.names, self.load_error = False, None, None
        try:
            reply = self._ask([prompt, program])
            if reply[0] != "ok" or len(reply) != 2 or type(reply[1]) is not dict:
                raise raised(reply)
            self.names = reply[1]
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {str(err)[:200]}"

    def _ask(self, message) -> list:
        try:
            self.requests.write(json.dumps(message) + "\n")
            self.requests.flush()
            line = self.replies.readline()
        except (OSError, ValueError):  # (a broken pipe; bytes that are not UTF-8)
            line = ""
        if not line:
            self.ended = True
            raise RuntimeError("the program's process ended")
        try:
            reply = json.loads(line)
        except ValueError:
            raise RuntimeError("the program's process answered something else than a reply") from None
        if type(reply) is not list or not reply:
            raise RuntimeError("the program's process answered something else than a reply")
        return reply

    def call(self, name: str, args: tuple, kwargs: dict):
        reply = self._ask([name, encode(args), encode(kwargs)])  # (TypeError: an argument that is not plain data)
        if reply[0] == "ok" and len(reply) == 2:
            try:
                return decode(reply[1])
            except Exception:
                raise RuntimeError(f"{name} returned something that is not plain data") from None
        raise raised(reply)

    def close(self):
        """End it; its exit status when it ended by itself (a signal: the CPU limit), else None."""
        if self.ended:
            try:
                return self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self.process.kill()
        self.process.wait()
        return None


def raised(reply: list) -> Exception:
    """The exception a failed call raises here: the builtin exception class the candidate named (its message
    kept), else RuntimeError. Only classes of this interpreter's own builtins, instantiated here."""
    name, message = (reply[1], reply[2]) if reply[0] == "err" and len(reply) == 3 else ("RuntimeError", "a malformed reply")
    cls = getattr(builtins, name, None) if type(name) is str and name not in NOT_REPLAYED else None
    text = message if type(message) is str else ""
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:  # (UnicodeDecodeError and the like take other arguments)
            pass
    return RuntimeError(f"{name if type(name) is str else 'an exception'}: {text}")


class Remote:
    """A name of the program, callable from the tests: each call runs in the candidate."""

    def __init__(self, process: CandidateProcess, name: str):
        self._process, self.__name__ = process, name

    def __call__(self, *args, **kwargs):
        return self._process.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<the program's {self.__name__}>"


def run_definitions(definitions: list, space: dict) -> None:
    """The prompt's definitions (def, class, import, assignment), each on its own: one that fails is left out."""
    for source in definitions:
        try:
            exec(compile(source, "<prompt>", "exec"), space)
        except BaseException:  # (the dataset's code; where it does not run, its names are simply not there)
            pass


def bind(space: dict, process, entry_point, needs, stubs) -> None:
    """The program's top-level names the tests need (code.py's `needs`: the names the tests and the prompt's
    definitions read that neither the test binds nor the prompt defines, and the prompt's stubs): its functions as
    proxies, the modules it imported as the harness's own import of them; never its data, never a name the
    prompt's definitions put here but a stub (`from m import *` included), and never a builtin's name (a program's
    own `abs` or `len` would answer for the test's). The entry point always."""
    for name in needs:
        kind = (process.names or {}).get(name) if type(name) is str else None
        if (type(kind) is not list or not kind or name.startswith("__") or name in vars(builtins)
                or name in space and name not in stubs):
            continue
        if kind == ["f"]:
            space[name] = Remote(process, name)
        elif kind[0] == "m" and len(kind) == 2 and type(kind[1]) is str:
            try:  # the harness's own import of that module (MBPP's tests read `math` from the program's imports)
                space[name] = importlib.import_module(kind[1])
            except (Exception, SystemExit):  # (only installed modules: -I keeps /tmp off the path)
                pass
    if entry_point:
        space[entry_point] = Remote(process, entry_point)


def run_tests(space: dict, job: dict, loaded: bool) -> tuple:
    """(passed, total): `all` mode 1 of 1 when check(candidate) and every item pass; `share` mode the items that
    pass, each on its own (an item from check() is check's body with one top-level assert: it is called as
    check(candidate), so its locals are the test's)."""
    test, items, entry = job["test"], job["items"], job["entry_point"]
    candidate = space.get(entry) if entry else None
    if entry:
        space["candidate"] = candidate  # (a `tests` item may name it so)
    if job["mode"] == "share":
        if not loaded:
            return 0, len(items)
        try:
            if test:
                exec(compile(test, "<test>", "exec"), space)
        except Exception as err:
            note(f"the test program failed: {type(err).__name__}: {err}")
            return 0, len(items)
        passed = 0
        for source in items:
            try:
                exec(compile(source, "<test>", "exec"), space)
                if job["calls_check"]:
                    space["check"](candidate)
                passed += 1
            except Exception:
                pass
        return passed, len(items)
    if not loaded:
        return 0, 1
    try:
        if test:
            exec(compile(test, "<test>", "exec"), space)
            space["check"](candidate)
        for source in items:
            exec(compile(source, "<assert>", "exec"), space)
    except Exception as err:
        note(f"a test failed: {type(err).__name__}: {str(err)[:200]}")
        return 0, 1
    return 1, 1


def note(text: str) -> None:
    sys.stderr.write(f"harness: {text}\n")
    sys.stderr.flush()


def harness() -> None:
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                               ctypes.c_ulong(0)) != 0:
        sys.exit("harness: prctl(PR_SET_DUMPABLE, 0) failed: the key would be readable; no verdict")
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.ftruncate(0, 0)  # (raises where stdin is not a file this process may write: then no verdict at all)
    key, _, payload = b"".join(chunks).partition(b"\n")
    job = json.loads(payload)
    with open(sys.argv[0], encoding="utf-8") as f:
        source = f.read()  # (this file: the candidate runs its `candidate`)
    space = {"__name__": "__main__", "__builtins__": builtins}
    run_definitions(job["prompt"], space)
    process = CandidateProcess(job["prompt"], job["program"], source)
    if process.load_error:
        note(f"the program did not load: {process.load_error}")
    bind(space, process, job["entry_point"], job["needs"], set(job["stubs"]))
    passed, total = run_tests(space, job, process.load_error is None)
    status = process.close()
    line = f"{passed} {total}"
    os.write(1, f"\n{line} {hmac.new(key, line.encode(), 'sha256').hexdigest()}\n".encode())
    if status is not None and status < 0:  # the candidate died of a signal (SIGXCPU: its CPU limit): say so
        os._exit(128 - status)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        candidate(int(sys.argv[2]), int(sys.argv[3]))
    else:
        harness()

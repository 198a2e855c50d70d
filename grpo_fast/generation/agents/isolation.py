"""A tool's result as text, and tools run in worker processes (`tool_isolation='process'`).

By default a tool runs in a thread of the training process (tools.py): it shares the trainer's memory, so
a native crash in it (a segfault in a C extension), `os._exit`, or a hang that holds the GIL ends or stalls
the run. With `tool_isolation='process'` each call runs in a worker process instead (`WorkerPool`): a worker
that dies, exits or outlives `tool_timeout` costs that one call (a counted failed call with an error result)
and is replaced for the next. Workers are plain `python -I <this file>` processes, not multiprocessing's
spawn: spawn re-imports the trainer's `__main__` (a user script without an `if __name__ == "__main__":`
guard would start training again), and this file imports only the standard library, so a worker starts
without loading torch (a light tool's first call in a new worker: 50 ms, later calls under 1 ms, measured on
the 2-core CI machine). A worker runs one call at a time in a session of its own: a call past its
deadline is ended by killing that session (the tool's own child processes with it), and a Ctrl-C at the
terminal, which is the trainer's to handle, does not reach it. A worker ends when the trainer does: an idle
one reads end-of-file on its socket, a busy one notices its parent is gone within a second.

This file is both a module (`grpo_fast.generation.agents.isolation`) and the worker's script, so everything a worker
runs (`result_text` too) uses the standard library only.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

MAX_WORKERS = 32  # worker processes at most (calls beyond wait for a free one, within their own timeout)


def valid_text(text: str) -> str:
    """`text` with each lone surrogate (JSON's "\\ud800", which a model may write and no UTF-8 encoder takes:
    tokenizers raise TypeError on it) replaced by U+FFFD; a valid surrogate pair becomes its character."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def result_text(value, max_chars: Optional[int] = None) -> str:
    """A tool's return value as the tool message's text (TRL: str(result)), cut to `max_chars` characters
    before anything else reads it (a 10 MB result costs what a short one does), lone surrogates replaced.
    Runs where the tool ran (its thread, its worker), so a `__str__` that raises or hangs is the call's."""
    text = value if isinstance(value, str) else str(value)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars]
    return valid_text(text)


def children_of_this_thread() -> list[int]:
    """The child processes this thread started and nobody has waited for yet (Linux lists a process's children
    per thread that started them, /proc/self/task/<tid>/children; elsewhere: none)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def wait_for(pids: list[int]) -> None:
    """Wait for these children, however long they run (so that none is left a zombie)."""
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # (its starter waited for it after all)
            pass


class ToolFailed(Exception):
    """A call that did not give a result; its message is the error result's text (after "error: ")."""


# ---- the worker side ----------------------------------------------------------------------------------


def _serve(fd: int, parent: int) -> None:
    """A worker's life: the trainer's sys.path, then (function, arguments, max_chars) -> ("ok", text) or
    ("error", text), one call at a time, until the trainer closes the socket or is gone."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)

    def watch_parent():  # (a busy worker does not read its socket: it notices a dead trainer here)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    sys.path[:] = conn.recv()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args, max_chars = pickle.loads(data)
            value = fn(**args)
            if hasattr(value, "__await__"):  # an async tool: its own event loop, for this call
                import asyncio

                async def wait(v=value):
                    return await v

                value = asyncio.run(wait())
            reply = ("ok", result_text(value, max_chars))
        except BaseException as err:  # noqa: BLE001 (a tool's failure is its result; SystemExit included)
            try:
                reply = ("error", f"{type(err).__name__}: {err}")
            except BaseException:  # noqa: BLE001 (an exception whose str() raises)
                reply = ("error", type(err).__name__)
            reply = (reply[0], valid_text(reply[1]))
        left = children_of_this_thread()  # (what the call started and left: waited for beside the next calls)
        if left:
            threading.Thread(target=wait_for, args=(left,), daemon=True).start()
        conn.send(reply)


# ---- the trainer side ---------------------------------------------------------------------------------


class _Worker:
    def __init__(self):
        from multiprocessing import Pipe

        here, there = Pipe()  # (a socketpair: one end each)
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(there.fileno()),
                                      str(os.getpid())], pass_fds=(there.fileno(),), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        there.close()
        self.conn = here
        self.conn.send(list(sys.path))  # (-I leaves out PYTHONPATH and the script's folder: the trainer's path)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # (its session: the tool's children too)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.conn.close()


class WorkerPool:
    """Worker processes, started on demand (at most MAX_WORKERS), each running one call at a time."""

    def __init__(self):
        self._idle: list[_Worker] = []
        self._count = 0
        self._free = threading.Condition()
        self.restarts = 0  # workers replaced after a crash or a timeout

    def call(self, fn: Callable, args: dict, max_chars: Optional[int], deadline: float) -> Optional[str]:
        """The call's text; None when the deadline passed first (its worker is then killed); ToolFailed when
        the tool raised or its worker died."""
        job = pickle.dumps((fn, args, max_chars))
        worker = self._take(deadline)
        if worker is None:
            return None
        try:
            worker.conn.send_bytes(job)
            if not worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                self._drop(worker)
                return None
            status, text = worker.conn.recv()
        except (EOFError, OSError):  # the worker died during the call
            self._drop(worker)
            # (imported here, in the trainer: a worker runs the standard library only)
            from ...processes import how_it_ended

            raise ToolFailed(f"the tool's worker process {how_it_ended(worker.proc.returncode)} during the call (a new "
                             f"worker runs the next call)") from None
        self._give(worker)
        if status != "ok":
            raise ToolFailed(text)
        return text

    def _take(self, deadline: float) -> Optional[_Worker]:
        with self._free:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    self._count -= 1  # (ended while idle: replaced)
                    worker.conn.close()
                if self._count < MAX_WORKERS:
                    self._count += 1
                    break
                if not self._free.wait(max(deadline - time.monotonic(), 0.0)) and time.monotonic() >= deadline:
                    return None
        try:
            return _Worker()
        except BaseException:
            with self._free:
                self._count -= 1
                self._free.notify()
            raise

    def _give(self, worker: _Worker) -> None:
        with self._free:
            self._idle.append(worker)
            self._free.notify()

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._free:
            self._count -= 1
            self.restarts += 1
            self._free.notify()

    def close(self) -> None:
        """End the idle workers (busy ones end when their call does, or with the trainer)."""
        with self._free:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.kill()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))

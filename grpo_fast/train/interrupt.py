"""SIGINT / SIGTERM during training: stop at a point from which the run resumes exactly.

torchrun, Slurm and Kubernetes send SIGTERM (and Ctrl-C sends SIGINT) some seconds before they kill.
While a round is still sampling and scoring, nothing of the run has changed but counters, so the
round is abandoned at once (`Interrupted` is raised into it and the trainer rewinds to the round's
start). Once the optimizer has started changing weights, the round is finished first. Either way
the trainer then writes a checkpoint and stops. A second signal aborts at once, saving nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """Raised into the abandonable part of a round by the first SIGINT/SIGTERM. A BaseException, as
    KeyboardInterrupt is, so that user code's `except Exception` (a reward function's) lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequests:
    """`with StopRequests() as stop:` catches SIGINT/SIGTERM (main thread only; elsewhere a no-op).

    stop.signum: the first signal received, or None. Inside `with stop.abandonable():` the first
    signal raises `Interrupted`; elsewhere it is only recorded, for the loop to read between rounds.
    """

    def __init__(self):
        self.signum = None
        self._abandonable = False
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame):
        if self.signum is not None:  # the second signal: the user insists
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborted without saving")
        self.signum = signum
        if self._abandonable:
            self._abandonable = False
            raise Interrupted(signum)

    @contextlib.contextmanager
    def abandonable(self):
        if self.signum is not None:
            raise Interrupted(self.signum)
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped `train()` after it wrote a checkpoint; the message says how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

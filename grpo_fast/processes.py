"""Processes of a run and how they end: a child's end in words, and a rank or child that dies with its parent.
Light (os, signal, sys): the launcher, the ranks (distributed.py) and the tool workers (generation/agents/
isolation.py) share it."""

from __future__ import annotations

import os
import signal
import sys

# the launcher's pid, for a rank to tell whether its parent is still the launcher (`die_with_launcher`)
LAUNCHER_PID_ENV = "GRPO_FAST_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Under torchrun (Linux): SIGKILL this process when its parent, torchrun's agent, dies.

    The kernel sends the signal when the *thread* that forked this process exits; torchrun's agent
    starts its workers from its main thread (and `run_torchrun` runs the agent on this process's
    main thread), so that is when the launcher ends. A launcher that died before this call is caught
    by comparing the parent with the pid it left in the environment. Idempotent; a no-op elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not die_with_parent():
        return  # (no prctl: nothing else to try; the ranks then outlive a killed launcher, as before)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        print(f"grpo-fast train: the launcher (pid {launcher}) has ended: rank {os.environ.get('RANK', '?')} stops",
              file=sys.stderr, flush=True)
        os._exit(1)


def die_with_parent() -> bool:
    """Ask the kernel for SIGKILL when this process's parent ends (Linux); whether it was granted."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def how_it_ended(code: int) -> str:
    """A child's end in words, from its exit code (negative: the signal that killed it, as subprocess gives it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"

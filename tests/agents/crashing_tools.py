"""Tools that crash the process running them, for the isolation and exit-status tests. A module of its own, light
to import (a tool_isolation='process' worker imports the module of each tool it runs, within the call's timeout).

`add` is the script's (tool_model.py), crashing: GRPO_FAST_TEST_CRASH=segv (default) segfaults when `a` is odd and
adds otherwise; =exit calls os._exit(0) at once (a scheduler would read that as a finished run)."""

import ctypes
import os
import subprocess
import time

from tests.agents import tool_model


def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    if os.environ.get("GRPO_FAST_TEST_CRASH", "segv") == "exit":
        os._exit(0)
    if int(a) % 2:
        ctypes.string_at(0)  # (reads address 0: SIGSEGV)
    return tool_model.add(a, b)


def segfault(text: str) -> str:
    """Crash the process natively.

    Args:
        text: Ignored.
    """
    ctypes.string_at(0)
    return text


def exit_quietly(text: str) -> str:
    """End the process with status 0.

    Args:
        text: Ignored.
    """
    os._exit(0)


def echo(text: str) -> str:
    """Repeat a text.

    Args:
        text: The text.
    """
    return text


def hang(text: str) -> str:
    """Never return (in practice).

    Args:
        text: Ignored.
    """
    time.sleep(600)
    return text


def forks(text: str) -> str:
    """Start a process and leave it (no wait); its pid.

    Args:
        text: Ignored.
    """
    return str(subprocess.Popen(["true"]).pid)

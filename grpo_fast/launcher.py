"""How `grpo-fast train` starts and watches its processes: the supervised child of one process, or torchrun's
agent in this process for N ranks; processes that die with their parent; one line for how a run ended.

- One process (`supervise`, below): the training runs in a child, so that a run that ended without
  finishing (a tool's os._exit(0), a native crash) never exits 0.
- N ranks: the launcher checks what it can before any rank starts (the CLI: options, the output folder,
  what many ranks do not run), then runs torchrun's agent here (`torch.distributed.run`, the code
  of the `torchrun` command), so this process is the ranks' parent.
- Each rank asks the kernel for SIGKILL when its parent dies (`processes.die_with_launcher`, PR_SET_PDEATHSIG):
  a kill -9 of the launcher ends every rank at once, and with it the output folder's lock. (torchrun
  starts each rank in its own session, so a signal to the launcher's process group does not reach them.)
- How it ended, one line in all: a rank's error is that rank's own line (a rank that sees a peer die
  names it, `distributed.py: dead_peers`); SIGTERM/SIGINT go to every rank, rank 0 saves and
  says where, and the launcher exits 128 + the signal; torchrun's own log and traceback stay out
  (`--debug` shows them).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

from .processes import LAUNCHER_PID_ENV, die_with_parent, how_it_ended


def run_torchrun(nproc: int, argv: list[str], debug: bool = False) -> int:
    """`torchrun --standalone --nproc_per_node nproc -m grpo_fast.cli <argv>` with its agent in this
    process; returns the exit code (0, a failed rank's code, or 128 + the signal that stopped the job)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not debug:  # the agent's notices ("Setting OMP_NUM_THREADS ...", "Sending process ... SIGTERM", ...)
        quiet = logging.getLogger("torch.distributed")
        quiet.propagate, quiet.handlers = False, [logging.NullHandler()]
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    sys.stdout.flush()
    try:
        run(parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "grpo_fast.cli", *argv]))
    except SignalException as err:  # every rank got the signal too; rank 0 has said where it saved
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        if debug:
            raise
        return _failure_code(err.failures, nproc)
    return 0


def _failure_code(failures: dict, nproc: int) -> int:
    """The job's exit code when ranks failed (torchrun lists those that failed before it stopped the
    rest). A rank that exited with a code said why in its own line, and a survivor names a rank that
    died; only when every rank was killed by a signal (an OOM kill, kill -9) has nobody spoken."""
    codes = [f.exitcode for f in failures.values()]
    if len(failures) < nproc or any(code > 0 for code in codes):
        return next((code for code in codes if code > 0), 1)
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    print(f"grpo-fast train: rank {rank} (pid {failure.pid}) {how_it_ended(failure.exitcode)}, and torchrun stopped "
          f"the other ranks",
          file=sys.stderr, flush=True)
    return 1


# ---- a run that ends without finishing never exits 0 ---------------------------------------------------
#
# os._exit(0) in a tool or a reward function, or a native crash, ends the training process without running a
# line more of it (no atexit, no finally): only a process outside it can tell a run that finished from one that
# stopped. So `grpo-fast train` is a small supervisor: it starts itself again (`this_command`, the same arguments)
# (SUPERVISOR_ENV tells it that it is the child), waits, and exits with the child's status, unless the child
# exited 0 without writing the "finished" byte on a pipe when its command returned (then 1) or was killed by
# a signal (then 128 + the signal, as a shell reports it); each with one line. `main(argv)` called from Python,
# the ranks under torchrun (whose launcher watches them) and GRPO_FAST_SUPERVISE=0 (a debugger) train in the
# calling process.
#
# Signals: the child gets each SIGINT / SIGTERM once. Ctrl-C at a terminal, Slurm and systemd (every process
# of the job), and `kill -TERM -<group>` signal both processes; `docker stop`, Kubernetes and `kill <pid>` the
# supervisor alone. The child reports each signal it receives on the same pipe (signal.set_wakeup_fd: a byte,
# written by the interpreter's C handler the moment it arrives); the supervisor forwards a signal of its own
# only when the child has reported no such signal within a second. (A second signal aborts a run without
# saving, so forwarding every signal would turn a cgroup-wide SIGTERM into an abort.) A kill -9 of the
# supervisor ends the child too (PR_SET_PDEATHSIG), as a kill -9 of the torchrun launcher ends its ranks.

SUPERVISOR_ENV = "GRPO_FAST_SUPERVISOR"  # "<supervisor pid>:<pipe fd>", in the child's environment
NO_SUPERVISOR_ENV = "GRPO_FAST_SUPERVISE"  # "0": train in the calling process (under a debugger)
_FINISHED = b"F"  # (no signal has this number: the byte a child writes when its command returned)
_SAME_SIGNAL = 1.0  # seconds within which the child's report and the supervisor's signal are one signal


def wants_supervisor() -> bool:
    """Whether `grpo-fast train` (one process) runs its training in a supervised child: not in a rank under
    torchrun (its launcher watches it), not in the child itself, not with GRPO_FAST_SUPERVISE=0."""
    return ("WORLD_SIZE" not in os.environ and SUPERVISOR_ENV not in os.environ
            and os.environ.get(NO_SUPERVISOR_ENV, "1") != "0")


def this_command() -> list[str]:
    """How this process was started, for its supervised child, so that the child imports what it would: the
    `grpo-fast` script itself (its folder first on sys.path, as here: `python -m` would put the working folder
    first, where a wandb.py or trl.py would shadow the package), or `python -m grpo_fast.cli` when run so."""
    script = sys.argv[0]
    if os.path.basename(script) == "cli.py" or not os.path.isfile(script):
        return [sys.executable, "-m", "grpo_fast.cli"]
    return [sys.executable, script]


def supervise(cmd: list[str]) -> int:
    """Run `cmd` (a `grpo_fast.cli` child) to its end, forwarding SIGINT/SIGTERM it did not get itself; its exit
    status, but never 0 for a child that did not say it finished."""
    from collections import Counter

    read_end, write_end = os.pipe()
    for fd in (read_end, write_end):
        os.set_blocking(fd, False)  # (set_wakeup_fd needs it; the reader polls)
    got: list = []  # (signal, when) the supervisor received and has not settled yet

    def note(signum, frame):
        got.append((signum, time.monotonic()))

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            child = subprocess.Popen(cmd, env={**os.environ, SUPERVISOR_ENV: f"{os.getpid()}:{write_end}"},
                                     pass_fds=(write_end,))
        finally:
            os.close(write_end)
        reported: list = []  # (signal, when) the child reported receiving, not matched to one of ours
        owed: Counter = Counter()  # signals we forwarded whose report has not come back yet
        finished = False
        while True:
            code = child.poll()
            now = time.monotonic()
            for byte in _read_all(read_end):
                if byte == _FINISHED[0]:
                    finished = True
                elif owed[byte]:
                    owed[byte] -= 1
                else:
                    reported.append((byte, now))
            for mine in list(got):
                theirs = next((r for r in reported if r[0] == mine[0] and abs(r[1] - mine[1]) <= _SAME_SIGNAL), None)
                if theirs is not None:  # the child got this one itself
                    reported.remove(theirs)
                    got.remove(mine)
                elif now - mine[1] > _SAME_SIGNAL:
                    got.remove(mine)
                    if code is None:
                        child.send_signal(mine[0])
                        owed[mine[0]] += 1
            reported = [r for r in reported if now - r[1] <= _SAME_SIGNAL]  # (older: sent to the child alone)
            if code is not None:
                break
            select.select([read_end], [], [], 0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(read_end)
    if finished:
        return code if code >= 0 else 128 - code
    how, status = how_it_ended(code), (128 - code if code < 0 else code or 1)
    print(f"grpo-fast train: the training process (pid {child.pid}) {how} before the run finished (a native crash "
          f"or os._exit in user code ends it at once: --tool_isolation process runs tools in worker processes); "
          f"--resume continues from its latest checkpoint", file=sys.stderr, flush=True)
    return status


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def supervised_child():
    """In the child of `supervise`: the pipe's fd (signals reported on it from now on), after arranging to end
    with the supervisor; None elsewhere."""
    value = os.environ.pop(SUPERVISOR_ENV, None)  # (popped: a `grpo-fast train` a tool runs is not our child)
    if value is None:
        return None
    parent, fd = (int(x) for x in value.split(":"))
    os.set_inheritable(fd, False)
    die_with_parent()  # (a kill -9 of the supervisor ends this process too)
    if os.getppid() != parent:  # (it ended before the line above)
        os._exit(1)
    if threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    return fd


def say_finished(fd) -> None:
    if fd is not None:
        try:
            os.write(fd, _FINISHED)
        except OSError:
            pass

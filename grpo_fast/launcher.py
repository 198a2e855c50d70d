"""`grpo-fast train --nproc_per_node N`: torchrun's agent in this process, ranks that die with it, and
one line for how the job ended.

- The launcher checks what it can before any rank starts (the CLI: options, the output folder,
  what many ranks do not run), then runs torchrun's agent here (`torch.distributed.run`, the code
  of the `torchrun` command), so this process is the ranks' parent.
- Each rank asks the kernel for SIGKILL when its parent dies (`die_with_launcher`, PR_SET_PDEATHSIG):
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
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # (no prctl: nothing else to try; the ranks then outlive a killed launcher, as before)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        print(f"grpo-fast train: the launcher (pid {launcher}) has ended: rank {os.environ.get('RANK', '?')} stops",
              file=sys.stderr, flush=True)
        os._exit(1)


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
    try:
        how = f"was killed by {signal.Signals(-failure.exitcode).name}"
    except ValueError:
        how = f"exited with {failure.exitcode}"
    print(f"grpo-fast train: rank {rank} (pid {failure.pid}) {how}, and torchrun stopped the other ranks",
          file=sys.stderr, flush=True)
    return 1

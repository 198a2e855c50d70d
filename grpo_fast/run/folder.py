"""The run's output folder: one writer at a time, and a fresh run never destroys an earlier one.

- `check_start` (before any work): first removes the temporary folders of killed checkpoint writes
  (when no run holds the folder); a fresh run refuses a folder that already holds files, unless
  told to resume it or to overwrite it; a resume of a run stopped before its first checkpoint
  starts again from step 0 (one warning; the trainer rewrites metrics.jsonl from there); under a
  torchrun restart (`TORCHELASTIC_RESTART_COUNT > 0`) a run resumes by itself.
- `RunLock`: an OS lock (`flock`) on `<output_dir>/.lock` for as long as the run writes there. The
  kernel releases it when the process dies, kill -9 included, so no stale lock outlives a run.
- `clear_run_files`: what `overwrite_output_dir` deletes (only the files a run writes).

`RunFolderOptions`: the folder, what a run keeps in it (checkpoints, final/) and whether it resumes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from ..options import mirror, options_record
from .checkpoint import TEMP_PREFIX, list_checkpoints, remove_stale_temp_folders, resolve_checkpoint

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# what a run writes into its folder (overwrite_output_dir deletes these and nothing else)
RUN_FILES = ("metrics.jsonl", "reward.png", "summary.json", "final", "tensorboard", "wandb", "run_config.json")
# what every start writes before its first step: a folder with one of these was a run's, checkpoint or not
STARTED_FILES = ("run_config.json", "metrics.jsonl")
_warned_step_zero: set[str] = set()  # output folders whose resume from step 0 this process has announced


@options_record
@dataclass(frozen=True)
class RunFolderOptions:
    """Where a run writes, what it keeps there and whether it continues the run that folder holds (GRPOConfig
    declares these fields itself: the run's folder is the config's, read above it)."""

    output_dir: str = mirror("outputs/grpo_fast")
    save_steps: int = mirror(0)
    save_final: bool = mirror(True)
    save_total_limit: Optional[int] = mirror(2)
    save_merged: bool = mirror(False)
    resume_from_checkpoint: Optional[str] = mirror(None)
    overwrite_output_dir: bool = mirror(False)

def check_start(options: RunFolderOptions, warn: bool = True) -> Optional[str]:
    """The checkpoint folder to resume from (None: a fresh run, or a resume from step 0), checked
    before any work; stale temporary folders are removed first (rank 0, the folder unlocked).

    Raises ValueError naming output_dir, --resume and --overwrite_output_dir when a fresh run would
    write into an earlier run's folder, and FileNotFoundError when there is nothing to resume.
    warn: say (once per process and folder, rank 0) that a resume starts again from step 0, or passes over
    a damaged newest checkpoint (checkpoint.resolve_checkpoint)."""
    out = options.output_dir
    if os.environ.get("RANK", "0") == "0":
        remove_stale_temp_folders_unless_locked(out)
    spec = options.resume_from_checkpoint
    if spec is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and (
            list_checkpoints(out) or _started(out)):
        spec = "latest"  # torchrun restarted this worker: continue the run from its own checkpoint
    if spec == "latest" and not list_checkpoints(out) and _started(out):
        if warn and os.environ.get("RANK", "0") == "0" and os.path.abspath(out) not in _warned_step_zero:
            _warned_step_zero.add(os.path.abspath(out))
            logger.warning("%s has no checkpoint yet (the run stopped before its first one was complete): resuming "
                           "from step 0 with its saved config; metrics.jsonl restarts there", out)
        return None
    if spec is not None:
        return resolve_checkpoint(spec, out, warn=warn)
    existing = _entries(out)
    if existing and not options.overwrite_output_dir:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ValueError(f"output_dir {out!r} already holds files ({shown}): pass --resume to continue that run, "
                         f"--overwrite_output_dir to replace it, or choose another --output_dir")
    return None


def remove_stale_temp_folders_unless_locked(output_dir: str) -> list[str]:
    """The temporary folders of killed checkpoint writes in output_dir, removed unless a live run
    holds the folder's lock (it may be writing one now); at every start, before anything refuses."""
    if not os.path.isdir(output_dir) or not any(n.startswith(TEMP_PREFIX) for n in os.listdir(output_dir)):
        return []
    try:
        with RunLock(output_dir):
            return remove_stale_temp_folders(output_dir)
    except RuntimeError:  # in use: the run that holds it cleans up after itself
        return []


def _started(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name)) for name in STARTED_FILES)


def clear_run_files(output_dir: str) -> None:
    """Delete an earlier run's files (checkpoints, final/, metrics, events, plot, summary)."""
    for name in _entries(output_dir):
        if name in RUN_FILES or name.startswith("checkpoint-") or name.startswith(TEMP_PREFIX):
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _entries(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n != LOCK_FILE)


class RunLock:
    """`with RunLock(output_dir):` holds an exclusive flock on `<output_dir>/.lock`, or raises
    RuntimeError naming the folder and the pid of the run that holds it."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.fd = None

    def __enter__(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(f"output_dir {os.path.dirname(self.path)!r} is in use by another run (pid {holder}); "
                               f"wait for it to finish or choose another --output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None

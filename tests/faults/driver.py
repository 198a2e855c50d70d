"""`grpo-fast` in a subprocess with a fault injected at a named point, for tests/faults/.

    python -m tests.faults.driver [--fault POINT:N] train --model ... (the grpo-fast arguments)

POINT is where the process kills itself with SIGKILL (as a crash, an OOM kill or a power cut
would), on its N-th visit:
    after_step   right after the N-th optimizer step (weights changed, nothing saved yet)
    in_save      inside the N-th checkpoint write, after the model files, before the trainer state
    in_metrics   halfway through writing the N-th metrics line (a torn line)
    in_final     inside the N-th write of final/, once its files are written, before it is renamed into place
    enospc       not a kill: the N-th checkpoint write fails with OSError(ENOSPC), as on a full disk
Or, to give a signal sent from outside a known place to land in, it sleeps N seconds:
    sleep_in_score   in every scoring of a round (nothing of the run changed yet)
    sleep_in_step    after every optimizer step (weights changed)
One torch thread, so that runs in separate processes compute bitwise alike.
"""

import errno
import os
import signal
import sys
import time

import torch


def _kill():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _on_nth(n: int, action):
    """A function that runs `action` on its n-th call."""
    calls = [0]

    def hit(*args):
        calls[0] += 1
        if calls[0] == n:
            action(*args)

    return hit


def _enospc():
    raise OSError(errno.ENOSPC, "No space left on device")


def _torn_line_then_kill(logger, step):
    with open(logger.path, "a") as f:
        f.write('{"step": %d, "reward": 0.' % step)  # half a record
    _kill()


def install(point: str, n: int) -> None:
    from grpo_fast import trainer
    from grpo_fast.reporting import metrics
    from grpo_fast.run import checkpoint
    from grpo_fast.train import generate

    if point == "after_step":
        real_step, hit = trainer.GRPOTrainer._optimizer_step, _on_nth(n, _kill)

        def optimizer_step(self, *args, **kwargs):
            out = real_step(self, *args, **kwargs)
            hit()
            return out

        trainer.GRPOTrainer._optimizer_step = optimizer_step
    elif point in ("in_save", "enospc"):
        real_save, hit = checkpoint.torch.save, _on_nth(n, _kill if point == "in_save" else _enospc)

        def save(obj, path, *args, **kwargs):
            if str(path).endswith(checkpoint.STATE_FILE):
                hit()
            return real_save(obj, path, *args, **kwargs)

        checkpoint.torch.save = save
    elif point == "in_final":
        real_write, hit = checkpoint.write_atomically, _on_nth(n, _kill)

        def write_atomically(target, write, **kwargs):
            if os.path.basename(target) == "final":
                return real_write(target, lambda tmp: (write(tmp), hit()), **kwargs)
            return real_write(target, write, **kwargs)

        checkpoint.write_atomically = write_atomically
    elif point == "in_metrics":
        real_log, hit = metrics.MetricsLogger.log, _on_nth(n, _torn_line_then_kill)

        def log(self, step, values):
            hit(self, step)
            return real_log(self, step, values)

        metrics.MetricsLogger.log = log
    elif point == "sleep_in_score":
        real_score = generate.score  # the generate stage scores as it samples (dynamic sampling)
        generate.score = lambda *args, **kwargs: (time.sleep(n), real_score(*args, **kwargs))[1]
    elif point == "sleep_in_step":
        real_step = trainer.GRPOTrainer._optimizer_step
        trainer.GRPOTrainer._optimizer_step = lambda self, *a, **k: (real_step(self, *a, **k), time.sleep(n))[0]
    else:
        raise SystemExit(f"unknown fault point {point!r}")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if argv[:1] == ["--fault"]:
        point, _, n = argv[1].partition(":")
        install(point, int(n))
        argv = argv[2:]
    from grpo_fast.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

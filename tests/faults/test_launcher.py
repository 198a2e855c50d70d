"""`grpo-fast train --nproc_per_node N`: what stops every rank is refused before torchrun starts, in
one line; the ranks die with their launcher (kill -9 included) and the run then resumes; a rank that
sees a peer die names it."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import REPO, fault_args


def _main(argv):
    from grpo_fast import cli

    return cli.main(argv)


def test_errors_under_nproc_per_node_are_one_line_before_torchrun_starts(tmp_path, capsys, monkeypatch):
    from grpo_fast import launcher

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launcher, "run_torchrun", lambda *args, **kwargs: pytest.fail("torchrun started"))
    earlier = tmp_path / "earlier"  # an earlier run's folder
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("{}\n")
    cases = [(["--loss_type", "bogus"], 2, "GRPOConfig.loss_type='bogus' is invalid"),  # the codes one process gives
             (["--dynamic_sampling"], 1, "dynamic_sampling=True is not supported under torchrun (WORLD_SIZE=2)"),
             (["--output_dir", str(earlier)], 1, "already holds files"),
             (["--model", str(tmp_path / "no-model")], 1, "model must be 'default' or a local model folder")]
    for extra, code, message in cases:
        assert _main(["train", "--nproc_per_node", "2", "--output_dir", str(tmp_path / "run"), *extra]) == code, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("grpo-fast train: ") and message in err, err


_PEER = """
import os, signal, sys
from grpo_fast.cli import peer_death_line
from grpo_fast import distributed

world = distributed.join()
if world.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    distributed.barrier(world)
except RuntimeError as err:
    print(peer_death_line(err, "grpo-fast train", "OUT", world.rank, world.size), flush=True)
"""


def test_a_rank_that_sees_a_peer_die_names_it():
    """Two gloo ranks (plain processes; torchrun is not needed for this): rank 1 dies by SIGKILL, and
    rank 0's broken collective (gloo: "Connection closed by peer") becomes a line naming rank 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", _PEER], cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=30)
    assert ranks[1].returncode == -signal.SIGKILL
    assert f"grpo-fast train: rank 1 (pid {ranks[1].pid}) died, so rank 0 stopped" in out, out + err[-2000:]
    assert "--output_dir OUT --resume --nproc_per_node 2" in out, out


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: this machine's init may never reap the orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
def test_kill9_of_the_launcher_ends_every_rank_and_the_printed_command_resumes(tmp_path, tiny_path, prompts_file,
                                                                              reference):
    """kill -9 of a 2-rank launcher after checkpoint-1: no rank outlives it by 10 s, the lock goes with
    them, and the resume command as the run prints it (`--output_dir X --resume --nproc_per_node 2`,
    nothing else), stopped once more by SIGTERM (exit 143, one line) and run again, finishes the run as the
    uninterrupted one (one process, the same global batch of 8) does: the same samples, the same weights up
    to float reduction order over 2 ranks."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    launch = [sys.executable, "-m", "grpo_fast.cli"]
    launcher = subprocess.Popen([*launch, *fault_args(tiny_path, prompts_file, out, "--nproc_per_node", "2",
                                                      "--per_device_train_batch_size", "4", "--save_steps", "1")],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        deadline = time.time() + 180
        while not (out / "checkpoint-1" / "trainer_state.pt").exists():
            assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.1)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks), ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.communicate(timeout=30)
        deadline = time.time() + 10
        while any(_alive(pid) for pid in ranks):
            assert time.time() < deadline, f"ranks {[p for p in ranks if _alive(p)]} outlived their launcher by 10 s"
            time.sleep(0.1)
    finally:
        for pid in [launcher.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (out / "final").exists(), "the kill came after the run had ended"
    resume = [*launch, "train", "--output_dir", str(out), "--resume", "--nproc_per_node", "2"]
    # the resumed launcher gets SIGTERM (what Slurm and Kubernetes send) after its first checkpoint: it saves,
    # exits 143 with one line (no torchrun traceback), and the same command then finishes the run
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    # (of 4 steps: the resumed run must still have a step to train after the checkpoint it writes, or the
    # signal lands after its last step; a kill -9 that came after checkpoint-2 leaves too few)
    if newest < 2:
        stopped = subprocess.Popen(resume, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while not (out / f"checkpoint-{newest + 1}" / "trainer_state.pt").exists():  # (one the resumed run wrote)
            assert stopped.poll() is None and time.time() < deadline, stopped.communicate()[1][-3000:]
            time.sleep(0.1)
        stopped.send_signal(signal.SIGTERM)
        _, err = stopped.communicate(timeout=120)
        assert stopped.returncode == 143, err[-3000:]
        said = [line for line in err.splitlines() if line.startswith("grpo-fast train: ")]
        assert len(said) == 1 and "SIGTERM" in said[0] and "Traceback" not in err, err[-3000:]
    done = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (Path(reference) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in want] == [1, 2, 3, 4], "each step logged once"
    for a, b in zip(rows, want, strict=True):  # the same samples: per-prompt seeds, whatever the rank count
        for name in ("reward", "completions/mean_length"):  # (pooled over 2 ranks: float64 rounding apart)
            assert math.isclose(a[name], b[name], rel_tol=1e-9), (name, a[name], b[name])
    weights, expected = load_file(out / "final" / "model.safetensors"), load_file(Path(reference) / "final" / "model.safetensors")
    initial = load_file(Path(tiny_path) / "model.safetensors")
    # 2 ranks sum gradients in another order, which Adam magnifies where gradients are ~0 over 4 steps at lr 3e-2:
    # the whole model within 1% of the update (a wrong resume, e.g. another step or optimizer state, is ~100%)
    diff = sum(float(((weights[n] - w) ** 2).sum()) for n, w in expected.items()) ** 0.5
    update = sum(float(((w - initial[n]) ** 2).sum()) for n, w in expected.items()) ** 0.5
    assert diff <= 1e-2 * update, f"the resumed 2-rank run's weights differ by {diff / update:.2e} of the update"

"""`grpo-fast train --nproc_per_node N`: what stops every rank is refused before torchrun starts, in
one line; the ranks die with their launcher (kill -9 included) and the run then resumes; a rank that
sees a peer die names it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.faults.conftest import REPO


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
from grpo_fast.train import distributed

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
def test_kill9_of_the_launcher_ends_every_rank_and_resume_continues(tmp_path, tiny_path, prompts_file):
    out = tmp_path / "run"
    args = ["--disable_tqdm", "--model", tiny_path, "--engine", "hf", "--dataset", prompts_file,
            "--reward_funcs", "tests.trainer.common:target_fraction", "--num_generations", "4",
            "--max_prompt_length", "32", "--max_completion_length", "8", "--max_tokens_per_microbatch", "128",
            "--save_steps", "1", "--mixed_precision", "no", "--eval_before_train", "false", "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "grpo_fast.cli", "train", "--nproc_per_node", "2", *args,
                                 "--per_device_train_batch_size", "4", "--max_steps", "1000"],
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
    # the lock went with them: --resume continues (one process, the same global batch of 8)
    last = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert _main(["train", "--output_dir", str(out), "--resume", "--max_steps", str(last + 1),
                  "--per_device_train_batch_size", "8"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 2)), f"checkpoint-{last}, then one step: {steps}"

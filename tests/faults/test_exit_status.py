"""A run that ends without finishing never exits 0: `grpo-fast train` trains in a child process
(`launcher.supervise`) and exits with its status, but 1 when the child exited 0 without saying it finished (a tool's
os._exit(0)) and 128 + the signal when a signal killed it (a segfault: 139), each with one line; the child gets
each SIGINT / SIGTERM once, whether the signal was sent to the supervisor alone or to both."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from grpo_fast import launcher
from tests.agents.tool_model import tool_prompts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a child that says it finished, as `cli.main` does when its command returns, then exits with `code`
FINISHED = ("import os; os.write(int(os.environ['GRPO_FAST_SUPERVISOR'].split(':')[1]), " + repr(launcher._FINISHED) +
            "); raise SystemExit({})")


@pytest.mark.parametrize("child, code, line", [
    (FINISHED.format(0), 0, None),
    (FINISHED.format(2), 2, None),  # (a refusal, an interrupted run: its own code, its own line)
    ("import os; os._exit(0)", 1, "exited with status 0 before the run finished"),
    ("import ctypes; ctypes.string_at(0)", 139, "was killed by SIGSEGV before the run finished"),
    ("import os; os._exit(5)", 5, "exited with status 5 before the run finished"),
])
def test_the_supervisor_never_exits_0_for_a_run_that_did_not_finish(capsys, child, code, line):
    assert launcher.supervise([sys.executable, "-c", child]) == code
    said = capsys.readouterr().err.splitlines()
    if line is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith("grpo-fast train: the training process (pid ") and line in said[0]


CHILD = """
import os, signal, sys, time
from grpo_fast.launcher import say_finished, supervised_child

fd = supervised_child()
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, frame: got.append(signal.Signals(signum).name))
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 120
while len(got) < 3 and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.5)  # (a duplicate would come within the supervisor's 1 s)
print("got", *got, flush=True)
say_finished(fd)
"""


def test_each_signal_reaches_the_child_once(tmp_path, capfd):
    """SIGTERM to the supervisor alone (docker stop), then to both (Slurm, systemd), then SIGINT to both (Ctrl-C):
    the child receives SIGTERM, SIGTERM, SIGINT, one each; the supervisor waits for it and exits 0."""
    pid_file = tmp_path / "pid"
    me, supervising = os.getpid(), threading.Event()
    supervising.set()

    def send():
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            if time.monotonic() > deadline or not supervising.is_set():
                return
            time.sleep(0.05)
        child = int(pid_file.read_text())
        for to_me, to_child, pause in [(signal.SIGTERM, None, 1.5), (signal.SIGTERM, signal.SIGTERM, 1.5),
                                       (signal.SIGINT, signal.SIGINT, 0.0)]:
            if not supervising.is_set():  # (the child ended early: a signal now would reach pytest itself)
                return
            if to_child is not None:
                os.kill(child, to_child)
            os.kill(me, to_me)
            time.sleep(pause)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        assert launcher.supervise([sys.executable, "-c", CHILD, str(pid_file)]) == 0
    finally:
        supervising.clear()
    sender.join(timeout=5)
    assert capfd.readouterr().out.splitlines()[-1] == "got SIGTERM SIGTERM SIGINT"


def test_a_tool_calling_os_exit_0_ends_the_run_with_status_1(tmp_path, tool_model_dir):
    """The run's one trainer process: the model's first call of `add` ends the training process with os._exit(0);
    `grpo-fast train` exits 1 with one line (before the supervisor it exited 0, as a finished run)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in tool_prompts(16)))
    argv = ["train", "--model", tool_model_dir, "--tools", "tests.agents.crashing_tools:add,tests.agents.tool_model:mul",
            "--dataset", str(rows), "--reward_funcs", "tests.agents.tool_model:right_answer", "--engine", "hf",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_prompt_length", "64",
            "--max_completion_length", "200", "--max_tokens_per_microbatch", "2048", "--max_steps", "2",
            "--eval_steps", "0", "--eval_before_train", "false", "--save_final", "false", "--mixed_precision", "no",
            "--disable_tqdm", "--output_dir", str(tmp_path / "run")]
    env = {**os.environ, "GRPO_FAST_TEST_CRASH": "exit", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "grpo_fast.cli", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    said = [line for line in done.stderr.splitlines() if line.startswith("grpo-fast train: ")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(said) == 1 and "exited with status 0 before the run finished" in said[0], done.stderr[-3000:]

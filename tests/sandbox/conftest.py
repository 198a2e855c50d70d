"""The sandbox tests' pre-flight: before any test that starts a fork bomb, a bounded check (forks that sleep,
counted) shows the process limit is in force, so the suite never launches an unbounded one."""

import pytest


@pytest.fixture(scope="session")
def process_limit_in_force():
    from grpo_fast.rewards.sandbox import Sandbox, SandboxOptions

    box = Sandbox(SandboxOptions(timeout=5, max_processes=8, workers=1))
    check = box.run("import os, time\nn = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
                    "            time.sleep(2); os._exit(0)\n        n += 1\nfinally:\n    print(n)")
    box.close()
    assert check.reason == "process_limit" and 0 < int(check.stdout) <= 8, f"the process limit is not in force: {check}"

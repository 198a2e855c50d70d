"""Programs that try to escape or exhaust the sandbox (grpo_fast/rewards/sandbox.py), each contained, the host checked
afterwards. These never skip: without bubblewrap the module's sandbox refuses to start, naming the setup step."""

import dataclasses
import os
import socket
import threading
import time

import pytest

from grpo_fast.rewards.sandbox import MAX_WORKERS, UID_BASE, Sandbox, SandboxOptions

# wall 5 s: under load (the other test worker's engines and ranks) bwrap + python took over 2 s to start, so a
# flood of output met the wall limit before its output limit
LIMITS = SandboxOptions(timeout=5, cpu_seconds=1, memory_mb=512, max_processes=8, output_bytes=4096, tmp_mb=16,
                        workers=2)


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox(LIMITS)  # (no bwrap: RuntimeError naming `apt-get install bubblewrap`)
    yield sandbox
    sandbox.close()


def _slot_processes() -> list[int]:
    """Host pids running as one of this process's sandbox slot uids (none may be left after a program; another
    test worker's programs run as its own)."""
    base = UID_BASE + MAX_WORKERS * (os.getpid() % 10_000)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except FileNotFoundError:
                continue
            if base <= uid < base + MAX_WORKERS:
                pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    deadline = time.monotonic() + 5
    while _slot_processes() and time.monotonic() < deadline:  # (a killed tree takes a moment to be reaped)
        time.sleep(0.05)
    assert _slot_processes() == [], "a sandboxed process outlived its program"


def test_a_plain_program_runs_with_its_stdin(box):
    result = box.run("import sys; print(sys.stdin.read()[::-1])", stdin="olleh")
    assert result.ok and result.stdout == "hello\n" and 0 < result.start_seconds < result.seconds


def test_host_files_are_out_of_reach_and_the_root_is_the_sandboxs(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-1").mkdir()
    read = box.run(f"print(open({str(secret)!r}).read())")
    assert read.exit_code == 1 and "FileNotFoundError" in read.stderr and "the host's" not in read.stdout
    write = box.run("open('/usr/escaped', 'w').write('x')")
    assert write.exit_code == 1 and "Read-only file system" in write.stderr and not os.path.exists("/usr/escaped")
    delete = box.run(f"import shutil; shutil.rmtree({str(run)!r})")
    assert delete.exit_code == 1 and (run / "checkpoint-1").is_dir()
    listing = box.run("import os; print(sorted(os.listdir('/')))")
    assert listing.ok and eval(listing.stdout) == sorted({"bin", "dev", "lib", "lib64", "proc", "sbin", "tmp", "usr"}
                                                         & set(eval(listing.stdout)))
    assert not {"root", "work", "home", "etc"} & set(eval(listing.stdout))


def test_no_network_a_loopback_listener_sees_no_connection(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(1)
    port, accepted = server.getsockname()[1], []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    result = box.run(f"import socket; s = socket.socket(); print(s.connect_ex(('127.0.0.1', {port})))")
    listener.join()
    server.close()
    assert result.ok and result.stdout.strip() == "111" and accepted == []  # ECONNREFUSED: its own empty loopback


def test_cpu_wall_and_memory_limits(box):
    # the CPU limit on a sandbox whose wall limit cannot come first: on the shared 2-core machines a busy loop
    # beside the other test worker got under half a core, and 2 s of wall time ran out before 1 s of CPU
    spinner = Sandbox(dataclasses.replace(LIMITS, timeout=30, workers=1))
    try:
        spin = spinner.run("while True: pass")
    finally:
        spinner.close()
    assert spin.reason == "cpu_time" and spin.seconds < 30, spin
    sleep = box.run("import time; time.sleep(60)")
    assert sleep.reason == "timeout" and sleep.exit_code is None and sleep.seconds < LIMITS.timeout + 2
    big = box.run("x = bytearray(10 * 2**30)")
    assert big.reason == "memory" and "MemoryError" in big.stderr


def test_the_process_limit_holds_before_any_fork_bomb(box, process_limit_in_force):
    """A pre-flight check first: forks that sleep, counted, cannot pass the limit. Only then the bomb."""
    check = box.run("import os, time\nn = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
                    "            time.sleep(3); os._exit(0)\n        n += 1\nfinally:\n    print(n)")
    assert check.reason == "process_limit" and 0 < int(check.stdout) <= LIMITS.max_processes, check
    bomb = box.run("import os\nn = 0\ntry:\n    while True:\n        os.fork()\n        n += 1\n"
                   "except OSError:\n    print(n, flush=True)\n    while True: pass")
    assert bomb.reason in ("process_limit", "cpu_time", "timeout"), bomb
    assert all(int(n) <= LIMITS.max_processes for n in bomb.stdout.split()), bomb.stdout
    # every process the bomb could make runs as a slot uid: none is left, so nothing of it holds memory (the host's
    # free memory is no measure of that here: the other test worker's engines move it by gigabytes meanwhile)
    deadline = time.monotonic() + 5
    while _slot_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slot_processes() == []


def test_output_and_file_limits(box):
    flood = box.run("import sys\nfor _ in range(2**14): sys.stdout.write('x' * 65536)")  # 1 GB
    assert flood.reason == "output_limit" and len(flood.stdout) == LIMITS.output_bytes
    one = box.run("f = open('/tmp/big', 'wb')\nfor _ in range(1024): f.write(b'x' * 2**20)")  # 1 GB to one file
    assert one.exit_code == 1 and ("No space left" in one.stderr or one.reason == "file_size"), one
    many = box.run("for k in range(64): open(f'/tmp/f{k}', 'wb').write(b'x' * (16 << 20))")  # 64 x 16 MB
    assert many.exit_code == 1 and "No space left" in many.stderr or many.reason == "file_size", many


def test_a_child_that_outlives_its_parent_is_killed_and_the_trainer_cannot_be_signalled(box):
    orphan = box.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                     "        time.sleep(60)\n    os._exit(0)\nprint('parent done')")
    assert orphan.ok and orphan.stdout == "parent done\n"  # (nothing_left_behind checks the grandchild is gone)
    kill = box.run(f"import os; os.kill({os.getpid()}, 9)")
    assert kill.exit_code == 1 and "ProcessLookupError" in kill.stderr  # its own PID namespace


def test_parallel_programs_have_their_own_process_budget(box):
    """Two programs at once, each forking up to the limit: both reach (nearly) the whole budget."""
    program = ("import os, time\nn = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
               "            time.sleep(1.5); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)")
    results = []
    threads = [threading.Thread(target=lambda: results.append(box.run(program))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = sorted(int(r.stdout) for r in results)
    assert counts[0] == counts[1] >= LIMITS.max_processes - 2, counts


def test_every_writable_mount_is_bounded(box):
    """Files of 12 MiB (under the file-size limit) until the first error, in each place a program could write:
    the root and /dev are read-only, /dev/shm and /tmp are tmpfs of tmp_mb (a size-less /dev/shm held 2.1 GB)."""
    fill = ("import errno, os\nfor where in ('/', '/dev', '/dev/shm', '/tmp'):\n    written, error = 0, None\n    try:\n"
            "        for k in range(8):\n            with open(os.path.join(where, f'fill{k}'), 'wb') as f:\n"
            "                for _ in range(12):\n                    f.write(b'x' * (1 << 20))\n"
            "                    written += 1 << 20\n    except OSError as err:\n"
            "        error = errno.errorcode.get(err.errno)\n    print(where, written >> 20, error)")
    result = box.run(fill)
    assert result.ok, result
    filled = {where: (int(mb), error) for where, mb, error in (line.split() for line in result.stdout.splitlines())}
    assert filled["/"] == filled["/dev"] == (0, "EROFS"), filled
    for where in ("/dev/shm", "/tmp"):
        assert filled[where][1] == "ENOSPC" and filled[where][0] <= LIMITS.tmp_mb, filled


def test_text_that_is_not_utf8_is_a_counted_failed_start_and_leaks_no_descriptor(box):
    """A lone surrogate ('\\ud800') in a program or its stdin cannot be written to the sandbox: a start_failed result
    (counted), not an exception, and every descriptor made for it closed; so is the python tool's answer."""
    from grpo_fast.rewards.code import python_tool

    box.metrics()
    before = sorted(os.listdir("/proc/self/fd"))
    results = [box.run("print('\ud800')") if k % 2 else box.run("print(input())", stdin="\ud800") for k in range(20)]
    assert sorted(os.listdir("/proc/self/fd")) == before, "descriptors leaked"
    assert all(r.reason == "start_failed" and "not UTF-8 text" in r.stderr for r in results), results[:2]
    assert box.metrics()["sandbox/start_failures"] == 20
    assert "[start_failed, exit status None]" in python_tool("print('\ud800')")


def test_a_start_that_runs_out_of_descriptors_closes_the_ones_it_made(box):
    """With the descriptor limit a few above what is open, the start fails at each step in turn (the memfds, the
    status pipe, Popen's own pipes): each a start_failed result, nothing left open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = sorted(os.listdir("/proc/self/fd"), key=int)
    free = lambda limit: limit - sum(int(fd) < limit for fd in before)  # (new descriptors take the lowest free numbers)
    reasons = []
    try:
        for extra in range(16):
            resource.setrlimit(resource.RLIMIT_NOFILE, (next(n for n in range(1, soft) if free(n) == extra), hard))
            reasons.append(box.run("print(1)").reason)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert sorted(os.listdir("/proc/self/fd"), key=int) == before, f"descriptors leaked with {extra} to spare"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert reasons[0] == "start_failed" and reasons[-1] == "exited" and set(reasons) == {"start_failed", "exited"}, reasons

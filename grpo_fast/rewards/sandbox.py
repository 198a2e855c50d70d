"""Run untrusted Python (code a model wrote) in a sandbox: bubblewrap for isolation, kernel limits for the rest.

    from grpo_fast.rewards.sandbox import Sandbox, SandboxOptions
    box = Sandbox(SandboxOptions(timeout=5))
    result = box.run("print(input()[::-1])", stdin="abc")     # -> SandboxResult(exit_code=0, stdout='cba\\n', ...)

What a program gets (`bwrap`, a Debian package; checked on bubblewrap 0.8):
- its own user, PID, network, IPC, UTS and cgroup namespaces: no network (an empty loopback of its own), no
  view of the host's processes (it cannot signal the trainer), nothing that outlives it (the PID
  namespace dies with it; bwrap dies with the trainer: `--die-with-parent`);
- a read-only /usr (the system `python3` from it, or the venv's base interpreter bound at /opt/python when
  the system has none), /proc and a minimal read-only /dev of its own, a read-only root, and two private
  tmpfs of at most `tmp_mb` each, /tmp (its working folder) and /dev/shm, gone with it: every mount it can
  write is bounded. Nothing under the repository, a home folder or a run's output folder is bound: the
  program's source reaches it through a file descriptor (`--file`);
- a seccomp filter (x86-64 and aarch64) that refuses SysV shared memory and message queues and memfd_create
  (memory that neither the address-space limit nor a mount's size bounds) and kills a process that switches
  to another syscall ABI (32-bit, x32);
- limits set with setrlimit before bwrap starts: address space (`memory_mb`, per process), CPU seconds,
  file size (`tmp_mb`), open files (`OPEN_FILES`), processes (`max_processes`, counted per uid: each worker
  slot runs as a uid of its own, not root, because the kernel exempts uid 0 from RLIMIT_NPROC), and from
  here: wall time (`timeout`, then the whole tree is killed; the time its processes spent waiting for a
  core is not charged, up to `WALL_BACKSTOP` x timeout in all) and output (`output_bytes` a stream, then
  killed).

Host memory one program can hold is then at most max_processes x memory_mb (address space, each process)
+ 2 x tmp_mb (the two tmpfs), plus kernel buffers (pipes, at most the kernel's per-user pipe quota, 64 MiB by
default; sockets, bounded by OPEN_FILES per process); a full pool holds `pool_size` times that.

What it does not guarantee: protection from kernel bugs (it shares the host's kernel), or the count of
processes of a uid that something else on the host also uses (the slot uids are `UID_BASE` + the trainer's
pid slot).
"""

from __future__ import annotations

import errno
import os
import platform
import queue
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from ..bounds import INTEGER_AT_LEAST_1, Bounds
from ..options import option, options_record

REASONS = ("exited", "timeout", "cpu_time", "memory", "process_limit", "output_limit", "file_size", "start_failed")
MAX_WORKERS = 64  # sandbox uids per process (programs at once, over every Sandbox of the process)
UID_BASE = 200_000  # slot uids: UID_BASE + MAX_WORKERS * (pid % 10_000) + slot (no user owns them; none is root)
_BWRAP_PROCESSES = 2  # bwrap itself and the shell that is pid 1 of the namespace count against the uid's limit
OPEN_FILES = 256  # RLIMIT_NOFILE of a sandboxed process: bounds the kernel buffers (sockets) it can hold
WALL_BACKSTOP = 4  # a program starved of CPU is still killed at WALL_BACKSTOP x timeout of wall time
SETUP_STEP = "apt-get install bubblewrap (scripts/setup_env.sh does it as root)"


@options_record
@dataclass(frozen=True)
class SandboxOptions:
    """Limits of one program: GRPOConfig's sandbox_* fields and unsafe_code_execution (`from_config`)."""

    timeout: float = option(10.0, "code_tests: wall seconds one program may run in the sandbox (then its whole process tree is killed; sandbox/timeouts).", bounds=Bounds(low=0, low_open=True, finite=True, text="seconds > 0"), config_name="sandbox_timeout")
    cpu_seconds: int = option(10, "code_tests: CPU seconds one program may use (RLIMIT_CPU).", bounds=INTEGER_AT_LEAST_1, config_name="sandbox_cpu_seconds")
    memory_mb: int = option(1024, "code_tests: address space of one program in MiB (RLIMIT_AS; past it allocations fail: sandbox/oom).", bounds=Bounds(low=64, integer=True), config_name="sandbox_memory_mb")
    max_processes: int = option(32, "code_tests: processes one program may run at once (RLIMIT_NPROC under a uid of its own; fork bombs stop there: sandbox/process_limit).", bounds=INTEGER_AT_LEAST_1, config_name="sandbox_max_processes")
    output_bytes: int = option(65536, "code_tests: bytes kept of each of a program's stdout and stderr; past it the program is killed (sandbox/output_limit).", bounds=INTEGER_AT_LEAST_1, config_name="sandbox_output_bytes")
    tmp_mb: int = option(64, "code_tests: size of a program's private /tmp (a tmpfs, its working folder) and its largest file, in MiB.", bounds=INTEGER_AT_LEAST_1, config_name="sandbox_tmp_mb")
    workers: Optional[int] = option(None, "code_tests: programs run at once, at most 64 (a uid each). None: one per usable core (os.sched_getaffinity; test programs are CPU-bound).", bounds=Bounds(low=1, high=64, integer=True), config_name="sandbox_workers")
    unsafe: bool = option(False, "Run model-written code (code_tests) without isolation, with the limits only, where bubblewrap is unavailable (the run's first line says so). Without it such a run is refused, naming the missing tool.", config_name="unsafe_code_execution")

    @property
    def pool_size(self) -> int:
        # one program a usable core: code_tests' programs are CPU-bound, and with 4 x cores at once on 2 cores a
        # correct program of 0.92 s timed out in 7 of 16 (bench_sandbox.py's busy pool: sandbox_cpu.md)
        return min(self.workers or usable_cores(), MAX_WORKERS)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class SandboxResult:
    exit_code: Optional[int]  # None when killed from here (timeout, output); negative: killed by that signal
    stdout: str
    stderr: str
    reason: str  # one of REASONS: why it stopped
    seconds: float  # wall time
    start_seconds: float = 0.0  # until bwrap had the program's process running (the sandbox's own start-up)

    @property
    def ok(self) -> bool:
        return self.reason == "exited" and self.exit_code == 0


def isolation_problem() -> Optional[str]:
    """None when bwrap runs a program here as an unprivileged user; else what is missing, in one line."""
    if shutil.which("bwrap") is None:
        return f"bubblewrap (bwrap) is not installed: {SETUP_STEP}"
    uid = _UIDS.get()
    seccomp = _memfd("seccomp", _SECCOMP) if _SECCOMP else None
    try:
        done = subprocess.run(_bwrap_args(_interpreter(), 64, seccomp_fd=seccomp) + [_interpreter()[0], "-c", "pass"],
                              preexec_fn=_limits(SandboxOptions(), uid), capture_output=True, timeout=30,
                              pass_fds=() if seccomp is None else (seccomp,))
    except (OSError, subprocess.SubprocessError) as err:
        return f"bwrap could not start a program: {err}"
    finally:
        _UIDS.put(uid)
        if seccomp is not None:
            os.close(seccomp)
    if done.returncode != 0:
        return f"bwrap could not start a program: {done.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _interpreter() -> tuple[str, list[str]]:
    """(the python path inside the sandbox, extra bwrap arguments that bind it)."""
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3", []
    base = sys.base_prefix  # the venv's base interpreter, bound under a neutral path
    return "/opt/python/bin/python3", ["--ro-bind", base, "/opt/python", "--setenv", "LD_LIBRARY_PATH", "/opt/python/lib"]


def _bwrap_args(interpreter: tuple[str, list[str]], tmp_mb: int, status_fd: Optional[int] = None,
                program_fd: Optional[int] = None, seccomp_fd: Optional[int] = None) -> list[str]:
    size = str(tmp_mb << 20)
    args = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):
        path = f"/{top}"
        if os.path.islink(path):  # a merged /usr (Debian 12): /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # every mount the program can write has a size: bwrap's root and --dev are tmpfs without one (a program
    # held 2.1 GB of host memory in /dev/shm), so those two are made read-only once their mount points exist
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--tmpfs", "/tmp",
             "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1", "--new-session", "--chdir", "/tmp",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "LANG", "C.UTF-8", *interpreter[1]]
    if status_fd is not None:
        args += ["--json-status-fd", str(status_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if program_fd is not None:
        args += ["--file", str(program_fd), "/tmp/main.py"]
    return args + ["--remount-ro", "/"]  # (last: the operations above create their mount points in it)


def _seccomp_filter() -> Optional[bytes]:
    """A classic BPF program for bwrap's --seccomp: EPERM for the calls that make memory no limit here
    bounds (SysV shm and message queues: the IPC namespace's limits are the kernel's, unbounded; memfd_create:
    only each file's size is bounded, not their number), and the kill for a syscall of another ABI (a 32-bit
    or x32 binary the program writes to /tmp would otherwise reach those calls by other numbers). None on an
    architecture without a table here (then those calls stay open: the module docstring's bound does not hold)."""
    table = {"x86_64": (0xC000003E, (29, 68, 319)), "aarch64": (0xC00000B7, (194, 186, 279))}  # shmget msgget memfd
    if platform.machine() not in table:
        return None
    audit_arch, numbers = table[platform.machine()]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, kill, deny = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM  # SECCOMP_RET_{ALLOW,KILL_PROCESS,ERRNO}
    n = len(numbers)
    program = [(ld, 0, 0, 4),  # seccomp_data.arch
               (jeq, 1, 0, audit_arch), (ret, 0, 0, kill),
               (ld, 0, 0, 0),  # seccomp_data.nr
               (jge, n + 1, 0, 0x40000000),  # x32's numbers (x86-64 only; none on aarch64): to deny
               *[(jeq, n - i, 0, nr) for i, nr in enumerate(numbers)],  # each: to deny
               (ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *op) for op in program)


_SECCOMP = _seccomp_filter()


def _limits(o: SandboxOptions, uid: Optional[int]):
    """preexec_fn (C-level calls only: no import, lock or allocation of Python's in the forked child): its own
    session, the kernel limits, then as root the slot's own unprivileged uid. Not root (uid None): the
    process count is the user's, so its limit is what the user already runs plus the program's share."""
    nproc = o.max_processes + _BWRAP_PROCESSES + (0 if uid is not None else _tasks_of(os.getuid()))

    def apply():
        os.setsid()  # its own process group: the whole tree is killed at once
        for limit, value in ((resource.RLIMIT_AS, o.memory_mb << 20), (resource.RLIMIT_FSIZE, o.tmp_mb << 20),
                             (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, OPEN_FILES)):
            resource.setrlimit(limit, (value, value))
        # SIGXCPU at the soft limit (the program ends, and says why), SIGKILL a second later
        resource.setrlimit(resource.RLIMIT_CPU, (o.cpu_seconds, o.cpu_seconds + 1))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    return apply


def _tasks_of(uid: int) -> int:
    """The threads running as `uid` now (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return count


class _SlotUids:
    """The process's sandbox uids, one per program running (every Sandbox of the process draws from it):
    UID_BASE + 64 * (pid % 10000) + slot, 64 slots; not root: None (the user's own uid)."""

    def __init__(self):
        self._free: Optional[queue.Queue] = None
        self._lock = threading.Lock()

    def _queue(self) -> queue.Queue:
        with self._lock:
            if self._free is None:
                self._free = queue.Queue()
                base = UID_BASE + MAX_WORKERS * (os.getpid() % 10_000)
                for k in range(MAX_WORKERS):
                    self._free.put(base + k if os.geteuid() == 0 else None)
            return self._free

    def get(self) -> Optional[int]:
        return self._queue().get()  # (blocks while all 64 run)

    def put(self, uid: Optional[int]) -> None:
        self._queue().put(uid)


_UIDS = _SlotUids()


class Sandbox:
    """Runs programs under `options`, up to `pool_size` at once (`run` blocks; `run_async` awaits); counts
    what happened (`metrics()` pops sandbox/seconds, start_seconds, timeouts, oom, process_limit,
    output_limit since the last call)."""

    def __init__(self, options: SandboxOptions = SandboxOptions()):
        self.options = options
        if not options.unsafe:
            problem = isolation_problem()
            if problem:
                raise RuntimeError(f"refusing to run model-written code without isolation: {problem}; or pass "
                                   f"--unsafe_code_execution to run it with limits only")
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(options.pool_size, thread_name_prefix="grpo_fast sandbox")
        self._counts = self._zero()

    @staticmethod
    def _zero() -> dict:
        return {"seconds": 0.0, "start_seconds": 0.0, "programs": 0, "timeouts": 0, "oom": 0, "process_limit": 0,
                "output_limit": 0, "start_failures": 0}

    def metrics(self) -> dict:
        with self._lock:
            c, self._counts = self._counts, self._zero()
        n = max(c.pop("programs"), 1)
        c["start_seconds"] /= n  # a mean per program; seconds: the programs' wall time summed
        return {f"sandbox/{k}": v for k, v in c.items()}

    async def run_async(self, program: str, stdin: str = "") -> SandboxResult:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._pool, self.run, program, stdin)

    def run(self, program: str, stdin: str = "") -> SandboxResult:
        uid = _UIDS.get()
        try:
            result = self._run(program, stdin, uid)
            if uid is not None and result.reason in ("timeout", "output_limit"):
                _wait_until_gone(uid)
        finally:
            _UIDS.put(uid)
        with self._lock:
            c = self._counts
            c["programs"] += 1
            c["seconds"] += result.seconds
            c["start_seconds"] += result.start_seconds
            key = {"timeout": "timeouts", "cpu_time": "timeouts", "memory": "oom", "process_limit": "process_limit",
                   "output_limit": "output_limit", "start_failed": "start_failures"}.get(result.reason)
            if key:
                c[key] += 1
        return result

    def _run(self, program: str, stdin: str, uid: Optional[int]) -> SandboxResult:
        o = self.options
        start = time.perf_counter()
        fds, proc, started, out, reason = [], None, [None], [bytearray(), bytearray()], None
        try:  # (every descriptor made here is closed on every way out: a failed start included)
            try:
                source, data = program.encode(), stdin.encode()
            except UnicodeEncodeError as err:  # (a lone surrogate, '\ud800': a str that is not text)
                return _start_failed(f"the program or its stdin is not UTF-8 text: {err}", start)
            try:
                # no host file holds the program or its stdin; stdin never blocks the trainer, whatever it reads
                fds += [_memfd("main.py", source), _memfd("stdin", data)]
                if _SECCOMP and not o.unsafe:
                    fds.append(_memfd("seccomp", _SECCOMP))
                status_r, status_w = os.pipe()
                fds += [status_r, status_w]
                interpreter = _interpreter()
                if o.unsafe:
                    cmd = [interpreter[0] if not interpreter[1] else sys.executable, "-I", f"/proc/self/fd/{fds[0]}"]
                else:
                    # pid 1 of the namespace is a shell, not the program: the kernel ignores signals pid 1 has no
                    # handler for (its CPU limit's SIGXCPU and SIGKILL included); bwrap's own init would instead
                    # leave two zombies of the slot uid for the host's init to reap, counted against the next
                    # program's processes
                    seccomp = fds[2] if _SECCOMP else None
                    cmd = _bwrap_args(interpreter, o.tmp_mb, status_w, fds[0], seccomp) + [
                        "/bin/sh", "-c", '"$0" -I /tmp/main.py; exit $?', interpreter[0]]
                proc = subprocess.Popen(cmd, stdin=fds[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=[fd for fd in fds if fd not in (fds[1], status_r)],
                                        preexec_fn=_limits(o, uid), close_fds=True)
            except (OSError, subprocess.SubprocessError) as err:  # (EAGAIN or EMFILE under load): this program only
                return _start_failed(f"could not start the sandbox: {err}", start)
            os.close(status_w)
            fds.remove(status_w)
            # (the clock starts once bwrap is running: forking a large trainer process is the trainer's time)
            reason = self._communicate(proc, status_r, started, out, _Clock(o.timeout, time.perf_counter(), proc.pid))
        finally:
            if proc is not None and (reason is not None or proc.poll() is None):
                _kill_tree(proc)
                proc.wait()
            for fd in fds:
                os.close(fd)
            for stream in (proc.stdout, proc.stderr) if proc is not None else ():
                stream.close()
        seconds = time.perf_counter() - start
        stdout, stderr = (b.decode(errors="replace") for b in out)
        if reason is None and started[0] is None and not o.unsafe:
            reason = "start_failed"  # bwrap itself failed (its error is in stderr)
        if reason in ("timeout", "output_limit") and _why(None, stderr) == "process_limit":
            reason = "process_limit"  # (a fork bomb's processes keep the streams open, or flood them: the cause)
        code = proc.returncode if reason in (None, "start_failed") else None
        return SandboxResult(code, stdout, stderr, reason or _why(code, stderr), seconds,
                             (started[0] - start) if started[0] is not None else 0.0)

    def _communicate(self, proc, status_fd: int, started: list, out: list, clock: "_Clock") -> Optional[str]:
        """Read both streams up to output_bytes each and bwrap's status, watching the clock; why it was
        killed ("timeout", "output_limit"), or None when it ended by itself."""
        o, reason = self.options, None
        streams = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 1, status_fd: 2}
        poller = select.poll()  # (not select(): no limit on the fd numbers of a busy process)
        for fd in streams:
            poller.register(fd, select.POLLIN)
        while streams and reason is None:
            left = clock.left()
            if left <= 0:
                return "timeout"
            for fd, _ in poller.poll(left * 1000):
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    del streams[fd]
                    continue
                k = streams[fd]
                if k == 2:  # bwrap's status: {"child-pid": N} once the program runs
                    if started[0] is None and b"child-pid" in chunk:
                        started[0] = time.perf_counter()
                    continue
                out[k] += chunk
                if len(out[k]) > o.output_bytes:
                    del out[k][o.output_bytes:]
                    reason = "output_limit"
        while reason is None:  # (the streams closed: it is ending; a program that closed them and runs on meets the clock)
            left = clock.left()
            if left <= 0:
                return "timeout"
            try:
                proc.wait(timeout=left)
                break
            except subprocess.TimeoutExpired:
                pass
        return reason

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _start_failed(why: str, start: float) -> SandboxResult:
    return SandboxResult(None, "", why, "start_failed", time.perf_counter() - start)


class _Clock:
    """The time a program is charged against `timeout`: wall time since `start`, less the time its processes waited
    for a core (run-queue delay, /proc/PID/task/TID/schedstat). The verdict is then on what the program did (ran,
    up to its CPU limit, or slept), not on how busy the machine was: 8 CPU-bound programs on 2 cores each wait
    3/4 of the time. Summed over the tree, since its processes mostly run one after another (bwrap, the shell,
    code_tests' harness, the program); a program whose processes wait side by side is credited more than its
    wall time, and ends at WALL_BACKSTOP x timeout of wall (or its CPU limit, each process) all the same."""

    def __init__(self, timeout: float, start: float, pid: int):
        self.timeout, self.start, self.pid, self.credit = timeout, start, pid, 0.0

    def left(self) -> float:
        now = time.perf_counter()
        if now - self.start - self.credit >= self.timeout:  # (the tree is read only once the clock seems to run out)
            self.credit = _waited(self.pid)
        return min(self.start + self.timeout + self.credit, self.start + WALL_BACKSTOP * self.timeout) - now


def _waited(root: int) -> float:
    """Seconds the live tasks of `root`'s process tree (as the host sees it) spent runnable but not running, summed;
    0.0 where the kernel does not say (no schedstat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # (the name in parentheses may hold spaces)
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, waited = [root], 0
    while tree:
        pid = tree.pop()
        tree += children.get(pid, [])
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    waited += int(f.read().split()[1])  # ns: on the CPU, waiting for it, slices
            except (OSError, ValueError, IndexError):
                pass
    return waited / 1e9


def _kill_tree(proc) -> None:
    """SIGKILL the program's process group (bwrap and whatever it started outside the PID namespace: nothing,
    normally); inside, the PID namespace dies with its init."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_until_gone(uid: int, seconds: float = 5.0) -> None:
    """After a kill, the tree's processes are orphans the host's init reaps (a second or two here): the slot
    is reused only once none of its uid is left, so they never count against the next program's processes."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_owned_by(entry, uid) for entry in os.listdir("/proc") if entry.isdigit()):
        time.sleep(0.02)


def _owned_by(pid: str, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except FileNotFoundError:
        return False


def _why(code: Optional[int], stderr: str) -> str:
    """Why a program that ended by itself stopped: a limit it hit, as its exit and last words show. The
    process limit first: a fork bomb's processes also run into the CPU and wall limits, but it hit that one."""
    if "Resource temporarily unavailable" in stderr and any(w in stderr for w in ("fork", "BlockingIOError", "spawn")):
        return "process_limit"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu_time"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr[-2000:] or "Cannot allocate memory" in stderr[-2000:]:
        return "memory"
    return "exited"


__all__ = ["REASONS", "Sandbox", "SandboxOptions", "SandboxResult", "isolation_problem"]

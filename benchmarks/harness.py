"""What the benchmarks share: timing, peak memory, a description of the machine, result files.

    import harness  # benchmarks/ is sys.path[0] when a benchmark runs as a script

    timing = harness.timeit(step, warmup=1, repeats=3, device="cuda")  # .times_s .best_s .median_s .result
    seconds = harness.time_call(step, device)                          # one synchronised call
    with harness.PeakMemory(device) as mem:
        step()
    mem.extra_bytes                                                   # peak in the block - in use at its start
    env = harness.environment()                                       # CPU model and flags, torch, GPU, load
    harness.write_results(out / "loss_cpu", result, markdown)         # loss_cpu.json + loss_cpu.md

Nothing here imports torch at import time: bench_engine sets OMP_WAIT_POLICY before torch loads.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The flags CPU matmul speed depends on: oneDNN runs bf16 on AMX tiles, fp32/bf16 on AVX-512 where present.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    """Wait for the kernels queued on a CUDA device, so that wall-clock time counts them; on the CPU, nothing."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


@dataclass
class Timing:
    times_s: list[float] = field(default_factory=list)  # one per timed call, in order
    result: object = None  # what the last timed call returned

    @property
    def best_s(self) -> float:  # on a shared CPU, the least disturbed run
        return min(self.times_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def mean_s(self) -> float:
        return sum(self.times_s) / len(self.times_s)


def timeit(fn, *, repeats: int, warmup: int = 0, device: str = "cpu") -> Timing:
    """Wall-clock seconds of `repeats` calls of fn() after `warmup` untimed ones; each timed call is
    synchronised before and after on a CUDA device."""
    for _ in range(warmup):
        fn()
    timing = Timing()
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        timing.result = fn()
        synchronize(device)
        timing.times_s.append(time.perf_counter() - start)
    return timing


def time_call(fn, device: str = "cpu") -> float:
    """Seconds of one synchronised call of fn(), for loops that interleave or measure between calls."""
    return timeit(fn, repeats=1, device=device).times_s[0]


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes(device: str = "cpu") -> int:
    """Peak memory so far: torch.cuda.max_memory_allocated on CUDA (since its last reset), else the
    process's peak RSS (ru_maxrss, KiB on Linux; only /proc/self/clear_refs lowers it)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(name: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name + ":")) * 1024  # kB


def release_memory() -> None:
    """Collect garbage and give freed heap back to the system, so that a baseline RSS is honest."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakMemory:
    """Extra peak memory of a `with` block: its peak minus what was in use at its start, in bytes.

    cuda: torch.cuda.max_memory_allocated (reset at the start) - torch.cuda.memory_allocated at the
          start: tensors only, not the caching allocator's reserve.
    cpu:  peak RSS - RSS at the start, where the peak is
          reset_rss_peak=False: the process's peak RSS (ru_maxrss), not reset at the start, so it is the
                block's own only where the process never held more before: run one measurement per
                process (bench_loss).
          reset_rss_peak=True: VmHWM, reset through /proc/self/clear_refs at the start: the block's own
                peak in a process that ran other things before (bench_trl).
    """

    def __init__(self, device: str = "cpu", *, reset_rss_peak: bool = False):
        self.cuda = str(device).startswith("cuda")
        self.reset_rss_peak = reset_rss_peak
        self.start_bytes = self.peak_bytes = self.extra_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
        else:
            self.start_bytes = rss_bytes()
            if self.reset_rss_peak:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
        return self

    def __exit__(self, *exc) -> None:
        if self.reset_rss_peak and not self.cuda:
            self.peak_bytes = _status_bytes("VmHWM")
        else:
            self.peak_bytes = peak_bytes("cuda" if self.cuda else "cpu")
        self.extra_bytes = self.peak_bytes - self.start_bytes


# ------------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------------


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def environment() -> dict:
    """What the numbers depend on: CPU model, cores and vector flags, torch and its threads, the GPU,
    and the load average now (the CPU is shared with other jobs)."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return dict(
        cpu=info.get("model name") or platform.processor() or platform.machine(),
        arch=platform.machine(),
        cores=os.cpu_count(),
        cpu_flags=[f for f in CPU_FLAGS if f in flags],
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        load_average=load_average(),
    )


def describe(env: dict) -> str:
    """One line: "NVIDIA H200, torch 2.11.0", or "AMD EPYC, 2 cores (avx2), torch 2.13.0+cpu (2 threads)"."""
    if env["gpu"]:
        return f"{env['gpu']}, torch {env['torch']}"
    flags = " ".join(env["cpu_flags"]) or "no AVX2/AVX-512/AMX"
    return f"{env['cpu']}, {env['cores']} cores ({flags}), torch {env['torch']} ({env['torch_threads']} threads)"


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


# ------------------------------------------------------------------------------------------------
# Result files
# ------------------------------------------------------------------------------------------------


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that reruns this benchmark from the repository root: "python benchmarks/<script> <args>"."""
    args = sys.argv[1:] if argv is None else argv
    return "python " + shlex.join([f"benchmarks/{Path(script).name}", *args])


def run_children(script: str, names, extra_args: list[str], runs: Path, timeout_min: float) -> None:
    """Run `script --child NAME --result runs/NAME.json *extra_args` for each name, one subprocess each
    (a fresh engine, its own peak memory); a failure or a timeout is reported and the next one runs.
    Each result is kept as soon as its child ends, so an interrupted run loses only the one in flight."""
    import subprocess
    import time

    tag = Path(script).stem
    runs.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"[{tag}] {name} ...", flush=True)
        cmd = [sys.executable, script, "--child", name, "--result", str(runs / f"{name}.json"), *extra_args]
        start, error = time.perf_counter(), None
        try:
            done = subprocess.run(cmd, timeout=60 * timeout_min, capture_output=True, text=True)
            if done.returncode != 0:
                error = f"failed: {done.stderr[-3000:]}"
        except subprocess.TimeoutExpired:
            error = f"over {timeout_min} min, stopped"
        if error:  # kept too: the report says which configuration did not finish, and why
            print(f"[{tag}] {name} {error}", flush=True)
            (runs / f"{name}.json").write_text(json.dumps({"error": error, "seconds": time.perf_counter() - start}) + "\n")
        print(f"[{tag}] {name}: {time.perf_counter() - start:.0f} s", flush=True)


def whole_run_command(script: str) -> str:
    """command_line without --only (and its names) and --report_only: a report that covers every
    configuration kept in runs/ was made by the whole run."""
    argv = [a for a in sys.argv[1:] if a != "--report_only"]
    if "--only" in argv:
        i = argv.index("--only")
        j = next((k for k in range(i + 1, len(argv)) if argv[k].startswith("--")), len(argv))
        argv = argv[:i] + argv[j:]
    return command_line(script, argv)


def write_results(stem: Path, result: dict, markdown: str | None = None, *, indent: int = 2) -> None:
    """stem.json (result) and, when given, stem.md (markdown); the folder is made. Benchmarks rewrite
    them after each part, so that a timeout keeps what was measured."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=indent) + "\n")
    if markdown is not None:
        stem.with_suffix(".md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")

"""Run TRL's own tests/test_grpo_trainer.py against stock TRL and against grpo_fast's backend, on local stand-ins.

    python -m benchmarks.trl_suite.run --trl /path/to/trl-checkout            # both modes, then the report
    python -m benchmarks.trl_suite.run --trl ... --mode backend -k tools      # one mode, a subset
    python -m benchmarks.trl_suite.compare                                    # the report from what is there

TRL's tests folder is copied to a scratch folder first (run from the checkout, pytest would put the checkout's
own `trl` package ahead of the installed one). Each mode writes, under --out, trl_suite_<mode>.xml (junit),
trl_suite_<mode>_logs.json (what the plugin recorded) and trl_suite_<mode>.log (pytest's output); then
compare.py writes trl_suite.md. See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import standins

REPO = Path(__file__).resolve().parents[2]
TEST_FILE = Path("tests") / "test_grpo_trainer.py"


def trl_tests(trl: Path) -> Path:
    """The tests folder of a TRL checkout (the checkout, its tests folder or the test file itself)."""
    trl = trl.resolve()
    for candidate in (trl, trl.parent.parent, trl.parent):
        if (candidate / TEST_FILE).is_file():
            return candidate / "tests"
    raise SystemExit(f"--trl {trl}: expected a TRL checkout with {TEST_FILE} (git clone --depth 1 "
                     "https://github.com/huggingface/trl)")


def run_mode(mode: str, tests: Path, cache: Path, out: Path, timeout: int, extra: list[str]) -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_CACHE=str(cache / "hub"), HF_HOME=str(cache / "hf_home"), TRL_SUITE_MODE=mode,
               TRL_SUITE_CACHE=str(cache), TRL_SUITE_LOGS=str(out / f"trl_suite_{mode}_logs.json"),
               TRL_EXPERIMENTAL_SILENCE="1", WANDB_MODE="disabled",
               # one thread: on a shared 2-core machine OpenMP threads spin against the other processes (the repo's
               # own suite runs one thread a worker for that reason: a vLLM module 327 s -> 55 s)
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [sys.executable, "-m", "pytest", str(tests / TEST_FILE.name), "-p", "benchmarks.trl_suite.plugin",
               "-p", "no:cacheprovider", "--timeout", str(timeout), "-rA", "-v", "--durations", "0",
               "--basetemp", str(tests.parent / "tmp"),
               "--junitxml", str(out / f"trl_suite_{mode}.xml"), *extra]
    print(f"[trl_suite] {mode}: {shlex.join(command)}", flush=True)
    started = time.time()
    with open(out / f"trl_suite_{mode}.log", "w") as log:
        code = subprocess.run(command, cwd=tests.parent, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return code, round(time.time() - started)


def _commit(trl: Path) -> str | None:
    folder = trl if trl.is_dir() else trl.parent
    done = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _versions() -> dict:
    from importlib import metadata

    return {name: metadata.version(name) for name in ("trl", "transformers", "torch", "peft", "liger_kernel")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl", type=Path, required=True, help="a TRL checkout (or its tests/test_grpo_trainer.py)")
    parser.add_argument("--mode", choices=("stock", "backend", "both"), default="both")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "trl_suite")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "grpo_fast" / "trl_suite",
                        help="where the stand-in models and datasets are built once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test (pytest-timeout)")
    args, extra = parser.parse_known_args(argv)
    cache = standins.build(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="trl_suite_"))
    try:
        tests = scratch / "tests"
        shutil.copytree(trl_tests(args.trl), tests, ignore=shutil.ignore_patterns("__pycache__"))
        modes = ("stock", "backend") if args.mode == "both" else (args.mode,)
        for mode in modes:
            code, seconds = run_mode(mode, tests, cache, args.out, args.timeout, extra)
            print(f"[trl_suite] {mode}: pytest exit {code} in {seconds} s", flush=True)
            record = dict(command=shlex.join(["python", "-m", "benchmarks.trl_suite.run", *(argv or sys.argv[1:])]),
                          trl_checkout=str(args.trl), trl_commit=_commit(args.trl), installed=_versions(),
                          pytest_exit=code, seconds=seconds, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
            (args.out / f"trl_suite_{mode}_run.json").write_text(json.dumps(record, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from . import compare

    compare.main(["--out", str(args.out)])


if __name__ == "__main__":
    main()

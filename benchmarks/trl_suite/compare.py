"""Write trl_suite.md from a stock and a backend run of TRL's GRPO tests (run.py's junit, logs and run records).

    python -m benchmarks.trl_suite.compare [--out benchmarks/results/trl_suite] [--md benchmarks/results/trl_suite.md]

It reports both pass counts, the tests whose outcome differs (with the backend's first error line), the tests that
fail in both, and, for every test that trained in both modes, whether the trainers logged the same metric names
and how far apart the first optimizer step's values are (relative: |a - b| / max(|a|, |b|)).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = ("stock", "backend")
TOLERANCE = 3e-3  # the relative agreement claimed for step-1 values under TRL's default bf16
NEAR_ZERO = 1e-4  # below this a value is a cancellation (an on-policy step-1 loss is a sum of advantages ~ 0): its
#                   relative difference measures rounding, not agreement; the absolute difference is what to read
TIMING = ("time", "runtime", "per_second", "flos")
# Why a test differs or fails in both modes, as found by reading it: {test id pattern (fnmatch): reason}, first match
EXPLANATIONS = Path(__file__).with_name("explanations.json")


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test -> (outcome, first line of its message) from a junit file."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{cls}::{case.get('name')}" if cls.startswith("Test") else case.get("name")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = child.get("message") or (child.text or "")
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = child.get("message") or ""
        results[name] = (outcome, (message.strip().splitlines() or [""])[0][:240])
    return results


def logs(path: Path) -> dict[str, list]:
    tests = json.loads(path.read_text())["tests"]
    return {nodeid.split("::", 1)[-1]: records for nodeid, records in tests.items()}


def metric_names(records: list) -> set[str]:
    names = set()
    for record in records:
        for entry in record.get("log_history") or []:
            names.update(key for key in entry if not any(t in key for t in TIMING))
    return names


def relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def step_one(records: list) -> dict[str, float]:
    """The first trainer's step-1 metrics and its mean micro-batch loss ('loss (training_step)')."""
    for record in records:
        if record.get("step1"):
            values = dict(record["step1"])
            if record.get("step1_losses"):
                values["loss (training_step)"] = sum(record["step1_losses"]) / len(record["step1_losses"])
            return values
    return {}


def report(out: Path) -> str:
    runs = {mode: json.loads((out / f"trl_suite_{mode}_run.json").read_text()) for mode in MODES}
    results = {mode: outcomes(out / f"trl_suite_{mode}.xml") for mode in MODES}
    recorded = {mode: logs(out / f"trl_suite_{mode}_logs.json") for mode in MODES}
    tests = sorted(set(results["stock"]) & set(results["backend"]))  # a partial run: what both modes ran
    one_mode = {mode: sorted(set(results[mode]) - set(tests)) for mode in MODES}

    def trains(mode, t):
        return any(r.get("log_history") for r in recorded[mode].get(t, []))

    trained = [t for t in tests if trains("stock", t)]
    lines = ["# TRL's GRPO test file: stock TRL vs the grpo_fast backend", "",
             "TRL's own `tests/test_grpo_trainer.py` run twice with the installed TRL on local stand-ins of its hub "
             "models and datasets (benchmarks/trl_suite/README.md): once as it is (stock), once with "
             "`trl.GRPOTrainer` replaced by `grpo_fast.integrations.trl.FastGRPOTrainer` (backend). "
             "Vision-language tests are deselected.", ""]
    for mode in MODES:
        run = runs[mode]
        lines.append(f"- {mode}: `{run['command']}` (TRL checkout commit {run['trl_commit']}, finished "
                     f"{run['finished']}, {run['seconds']} s, pytest exit {run['pytest_exit']})")
    lines += [f"- installed: {', '.join(f'{k} {v}' for k, v in runs['stock']['installed'].items())}", ""]

    lines += [f"## Counts ({len(tests)} tests run in both modes)", "",
              "| mode | passed | failed | error | skipped | xfailed | tests that train: passed |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in MODES:
        got = [results[mode][t][0] for t in tests]
        passed_training = sum(results[mode][t][0] == "passed" for t in trained)
        lines.append(f"| {mode} | " + " | ".join(str(got.count(k)) for k in ("passed", "failed", "error", "skipped",
                                                                          "xfailed"))
                     + f" | {passed_training} of {len(trained)} |")
    lines += ["", "A test that trains: one whose stock run called `trainer.train()` (recorded by the plugin).", ""]
    for mode in MODES:
        if one_mode[mode]:
            got = [results[mode][t][0] for t in one_mode[mode]]
            lines += [f"Run in {mode} mode only (the runs selected different tests): {len(got)}, "
                      + ", ".join(f"{got.count(k)} {k}" for k in ("passed", "failed", "error", "skipped", "xfailed")
                                  if got.count(k)) + ".", ""]
            failing = [t for t in one_mode[mode] if results[mode][t][0] in ("failed", "error")]
            if failing:
                lines += [f"| failing in {mode} only run | first error line | why |", "| --- | --- | --- |"]
                lines += [f"| `{t}` | {_cell(results[mode][t][1])} | {why(t)} |" for t in failing] + [""]

    differing = [t for t in tests if results["stock"][t][0] != results["backend"][t][0]]
    lines += [f"## Tests whose outcome differs ({len(differing)})", ""]
    if differing:
        lines += ["| test | stock | backend | first error line (the failing mode's) | why |",
                  "| --- | --- | --- | --- | --- |"]
        for t in differing:
            (s, sm), (b, bm) = results["stock"][t], results["backend"][t]
            lines.append(f"| `{t}` | {s} | {b} | {_cell(bm if b in ('failed', 'error') else sm)} | {why(t)} |")
    both = [t for t in tests if t not in differing and results["stock"][t][0] in ("failed", "error")]
    lines += ["", f"## Tests that fail in both modes ({len(both)})", ""]
    if both:
        lines += ["| test | stock's first error line | backend's | why |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t}` | {_cell(results['stock'][t][1])} | {_cell(results['backend'][t][1])} | {why(t)} |"
                  for t in both]

    compared = [t for t in trained if trains("backend", t)]
    lines += ["", f"## Metric names ({len(compared)} tests that trained in both modes)", ""]
    name_diffs = []
    for t in compared:
        stock, backend = metric_names(recorded["stock"][t]), metric_names(recorded["backend"][t])
        if stock != backend:
            name_diffs.append(f"- `{t}`: only stock {sorted(stock - backend)}, only backend {sorted(backend - stock)}")
    lines += name_diffs or ["Every one logged the same metric names in both modes (timing metrics aside)."]

    worst: dict[str, tuple[float, str, float, float]] = {}
    largest_gap: dict[str, float] = {}
    for t in compared:
        stock, backend = step_one(recorded["stock"][t]), step_one(recorded["backend"][t])
        for name in set(stock) & set(backend):
            largest_gap[name] = max(largest_gap.get(name, 0.0), abs(stock[name] - backend[name]))
            if max(abs(stock[name]), abs(backend[name])) < NEAR_ZERO:
                continue
            rel = relative(stock[name], backend[name])
            if name not in worst or rel > worst[name][0]:
                worst[name] = (rel, t, stock[name], backend[name])
    lines += ["", "## Step-1 values", "",
              f"The first optimizer step's metrics (TRL's `_metrics` means) and mean micro-batch loss, per metric the "
              f"largest relative difference over the tests that trained in both modes (tolerance {TOLERANCE:g}), "
              f"values under {NEAR_ZERO:g} in magnitude left out of the relative column (a cancellation: read the "
              f"largest absolute difference). With random hidden-8 stand-ins every next-token distribution is near "
              f"uniform (entropy ln 151,936 = 11.93) and an on-policy step-1 loss is a cancellation of advantages, so "
              f"the sharpest comparisons here are aux_loss and the MoE losses that contain it; the fused ops' accuracy "
              f"on non-uniform distributions is what tests/integrations/test_trl.py checks.", "",
              "| metric | max relative difference | in test | stock | backend | max absolute difference |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name in sorted(largest_gap):
        if name in worst:
            rel, t, s, b = worst[name]
            flag = "" if rel <= TOLERANCE else " **over**"
            lines.append(f"| {name} | {rel:.2e}{flag} | `{t}` | {s:.6g} | {b:.6g} | {largest_gap[name]:.2e} |")
        else:
            lines.append(f"| {name} | (all near zero) | | | | {largest_gap[name]:.2e} |")
    return "\n".join(lines) + "\n"


def why(test: str) -> str:
    reasons = json.loads(EXPLANATIONS.read_text()) if EXPLANATIONS.exists() else {}
    return _cell(next((reason for pattern, reason in reasons.items() if fnmatch.fnmatchcase(test, pattern)), ""))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "results"
    parser.add_argument("--out", type=Path, default=default / "trl_suite", help="run.py's --out")
    parser.add_argument("--md", type=Path, default=default / "trl_suite.md")
    args = parser.parse_args(argv)
    if not all((args.out / f"trl_suite_{mode}_run.json").exists() for mode in MODES):
        print(f"[trl_suite] {args.out}: needs a stock and a backend run before the report")
        return
    args.md.write_text(report(args.out))
    print(f"[trl_suite] wrote {args.md}")


if __name__ == "__main__":
    main()

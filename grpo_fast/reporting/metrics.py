"""What a run reports: metrics.jsonl, the trackers of `report_to` (grpo_fast/reporting/trackers.py: TensorBoard
by default, wandb, trackio, mlflow), a PNG of reward and eval accuracy, and a live progress bar.
Names follow TRL (reward, reward_std, rewards/<func>/mean, kl, entropy, ...).

The run's own files land in its output_dir. The trackers and matplotlib load lazily; a missing
matplotlib or default TensorBoard is reported once and skipped (the jsonl file is always written).

How a metric combines over ranks is declared here (`reduction`, `Pooled`, `combine`), so that N
ranks log what one process with the same global batch logs: counts add up, extremes stay
extremes, and a mean or std over values (rewards, lengths) is pooled from every rank's values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

from .options import ReportOptions
from .trackers import catch_up, close_all, scalars

logger = logging.getLogger(__name__)

PROGRESS_KEYS = ("reward", "eval/accuracy", "completions/mean_length", "step_time")

# Counts (and rates of counts): a rank's figure is its share of the whole, so the ranks' figures add up.
SUMMED = frozenset({
    "num_tokens", "num_micro_batches", "tokens_per_second", "rewards/non_finite",
    "rollout/generated_tokens", "rollout/reprefill_tokens", "rollout/carried_over", "rollout/dropped_stale",
    "rollout/in_flight", "rollout/restarted_trajectories", "judge/tokens", "judge/requests", "judge/unparsable", "judge/overlong",
    "sandbox/seconds", "sandbox/oom", "sandbox/process_limit", "sandbox/output_limit", "code/no_code",
    "code/syntax_errors",
})


def reduction(name: str) -> str:
    """How the ranks' values of the scalar metric `name` combine: "sum" for the counts of `SUMMED`;
    "max" / "min" for a name whose last part has the word max / min (`completions/max_length`,
    `sampling/logp_diff_max`, `.../importance_sampling_ratio/min`); else "mean" (a per-rank mean over
    equal shares of the batch, or a figure every rank has alike). Values that need more than one
    number to pool exactly (a mean or std over a rank's own values) are `Pooled` instead."""
    if name in SUMMED or name.endswith("/timeouts"):  # (rewards/<name>/timeouts: calls past reward_timeout)
        return "sum"
    words = name.rsplit("/", 1)[-1].split("_")
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


@dataclass(frozen=True)
class Pooled:
    """The mean or the (sample) std of a set of values, kept as (count, mean, sum of squared
    deviations) so that ranks' sets pool exactly (Chan et al.'s update): the logged figure is the
    statistic of all ranks' values together, as one process computes it. `n` may be a weight (a
    token count) when only the mean is asked for."""

    stat: str  # "mean" or "std"
    n: float
    mean: float
    m2: float = 0.0

    @classmethod
    def of(cls, values, stat: str = "mean") -> "Pooled":
        """Of a 1-D tensor (or sequence) of values; NaN values are missing and left out."""
        import torch

        x = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        x = x[~x.isnan()]
        if not x.numel():
            return cls(stat, 0, math.nan)
        mean = x.mean()
        return cls(stat, x.numel(), mean.item(), float(((x - mean) ** 2).sum()))

    @classmethod
    def weighted(cls, mean: float, weight: float) -> "Pooled":
        """A mean over `weight` items (a token mean over its tokens): ranks give the weighted mean."""
        return cls("mean", float(weight), float(mean))

    def __add__(self, other: "Pooled") -> "Pooled":
        assert self.stat == other.stat, (self, other)
        if not other.n:
            return self
        if not self.n:
            return other
        n = self.n + other.n
        delta = other.mean - self.mean
        return Pooled(self.stat, n, self.mean + delta * other.n / n, self.m2 + other.m2 + delta ** 2 * self.n * other.n / n)

    @property
    def value(self) -> float:
        if self.stat == "mean":
            return self.mean if self.n else math.nan
        return math.sqrt(max(self.m2, 0.0) / (self.n - 1)) if self.n > 1 else 0.0  # torch.std's; 0 for one value


def combine(per_rank: Sequence[dict]) -> dict:
    """One value per metric from every rank's metrics (the union of their names, in first-seen order):
    `Pooled` values pooled, scalars combined by `reduction` over the ranks that have a finite value
    (NaN where none has). One rank's dict comes back with its `Pooled` values resolved."""
    out = {}
    for name in dict.fromkeys(n for m in per_rank for n in m):
        values = [m[name] for m in per_rank if name in m]
        if len(per_rank) == 1 and not isinstance(values[0], Pooled):
            out[name] = values[0]
            continue
        if isinstance(values[0], Pooled):
            total = values[0]
            for v in values[1:]:
                total = total + v
            out[name] = total.value
            continue
        finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        how = reduction(name)
        if not finite:
            out[name] = math.nan
        elif how == "sum":
            out[name] = sum(finite)
        elif how == "max":
            out[name] = max(finite)
        elif how == "min":
            out[name] = min(finite)
        else:
            out[name] = sum(finite) / len(finite)
    return out


def _clean(value):
    """A JSON-safe float (NaN/inf become null: JSON has no spelling for them)."""
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Append one JSON line per logged step to `<output_dir>/metrics.jsonl` and mirror it to the trackers
    of `report_to` (grpo_fast/reporting/trackers.py).

    `history` keeps every logged record in memory for the plot; a resumed run reloads the records
    already in the file (up to the resumed step) so the plot covers the whole run, and gives each tracker
    the ones its run lacks (`trackers.catch_up`: a kill -9 loses what a tracker had not written yet).
    """

    def __init__(self, output_dir: str, *, resume_step: int = 0, trackers: Sequence = ()):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.history = self._reload(resume_step) if resume_step else []
        tmp = self.path + ".tmp"  # rewrite without records past the resumed step; a kill keeps the old file
        with open(tmp, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in self.history)
        os.replace(tmp, self.path)
        self.trackers = list(trackers)  # report_to's (grpo_fast/reporting/trackers.py), started by the caller
        catch_up(self.trackers, self.history)

    def _reload(self, resume_step: int) -> list[dict]:
        """The records up to `resume_step`. A torn last line (the process was killed mid-write) is
        dropped with a warning; a malformed line elsewhere is an error naming the file and line."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
        records = []
        for k, (line_no, line) in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if k == len(lines) - 1:
                    logger.warning("%s: dropped a torn last line %d (%s): the run was stopped while writing it",
                                   self.path, line_no, err.msg)
                    continue
                raise ValueError(f"{self.path}, line {line_no}: malformed JSON ({err.msg}); fix or remove that line "
                                 f"to resume") from None
        return [r for r in records if r.get("step", 0) <= resume_step]

    def log(self, step: int, metrics: dict) -> dict:
        record = {"step": step, "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(step, values)
        return record

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        """A table (the sampled completions) to the trackers that show tables."""
        for tracker in self.trackers:
            tracker.log_table(step, columns, rows)

    def plot(self, filename: str = "reward.png") -> str | None:
        """Write reward (and eval accuracy when logged) against step to a PNG; return its path."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - matplotlib is a dependency
            logger.warning("matplotlib unavailable (%s): no plot", err)
            return None
        series = {key: [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
                  for key in ("reward", "eval/accuracy")}
        if not any(series.values()):
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        if series["reward"]:
            ax.plot(*zip(*series["reward"], strict=True), label="train reward (mean)", color="tab:blue", alpha=0.8)
        if series["eval/accuracy"]:
            ax.plot(*zip(*series["eval/accuracy"], strict=True), "o-", label="held-out accuracy", color="tab:red")
        ax.set_xlabel("step")
        ax.set_ylabel("reward / accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(self.output_dir, filename)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def close(self):
        close_all(self.trackers)
        self.trackers = []


class ProgressBar:
    """A rich progress bar over optimizer steps showing the key figures of the last step."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, messages: bool = True):
        self.progress, self.total, self.messages = None, total, messages  # messages: print() shows (rank 0's)
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
            TimeRemainingColumn(), TextColumn("{task.fields[figures]}"),
        )
        self.task = self.progress.add_task("train", total=total, completed=start, figures="")
        self.progress.start()

    def update(self, step: int, metrics: dict):
        figures = "  ".join(f"{k.split('/')[-1]} {metrics[k]:.3g}" for k in PROGRESS_KEYS
                            if metrics.get(k) is not None and math.isfinite(metrics[k]))
        if self.progress is None:
            return
        self.progress.update(self.task, completed=step, figures=figures)
        if not self.progress.console.is_terminal:  # a log file: one line per step instead of a live bar
            self.progress.console.print(f"step {step}/{self.total}  {figures}")

    def print(self, message):
        """A line, or a rich renderable (a table), above the bar (rank 0 only). A line is text, never rich
        markup: the names and paths in it are the user's (an eval metric, an output folder) and may hold brackets."""
        if not self.messages:
            return
        if self.progress is not None:
            self.progress.console.print(message, markup=False, emoji=False)
        elif isinstance(message, str):
            print(message, flush=True)
        else:
            from rich.console import Console

            Console().print(message)

    def close(self):
        if self.progress is not None:
            self.progress.stop()


# ---- the trainer's timers and loggers --------------------------------------------------------


def synced_time(start: float) -> float:
    """Seconds since `start`, after the GPU's queued work (a stage's time includes its kernels)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


@contextlib.contextmanager
def timed(times: dict, name: str):
    """Add the block's wall time to times[name]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + synced_time(start)


def logs_step(step: int, options: ReportOptions) -> bool:
    """Whether optimizer step `step` writes a metrics line."""
    return step % options.logging_steps == 0 or step == options.max_steps


def open_logger(options: ReportOptions, params: dict, state, main: bool):
    """Rank 0's MetricsLogger (resuming at `state.step`, with the trackers of `options.report_to`, continuing
    the runs in `state.tracker_runs`; `params`: the run's options as the trackers record them, GRPOConfig.to_dict());
    other ranks write nothing (rank 0 writes the all-rank means)."""
    if not main:
        return OtherRankMetrics()
    from .trackers import open_trackers

    return MetricsLogger(options.output_dir, resume_step=state.step,
                         trackers=open_trackers(options, params, state.tracker_runs, state.step))


def progress(options: ReportOptions, step: int, main: bool = True) -> "ProgressBar":
    return ProgressBar(options.max_steps, step, enabled=main and not options.disable_tqdm, messages=main)


class OtherRankMetrics:
    """The metrics logger of a rank other than 0: writes nothing (rank 0 writes the all-rank means)."""

    path = None

    def log(self, step: int, metrics: dict) -> dict:
        return metrics

    def log_table(self, step: int, columns, rows) -> None:
        pass

    def plot(self):
        return None

    def close(self) -> None:
        pass


def reduce_metrics(metrics: dict, world) -> dict:
    """One value per metric over every rank's values (`world`: distributed.World), as `combine` declares it
    (sums for counts, min / max for extremes, pooled means and stds from all ranks' values, else the mean over
    the ranks); one process: its own values, `Pooled` ones resolved."""
    from ..distributed import gather_objects  # (torch: this module stays light)

    return combine(gather_objects(metrics, world))

"""Where a run's metrics go besides `metrics.jsonl` (always written): `report_to`, with TRL's values
(`tensorboard`, `wandb`, `trackio`, `mlflow`, `none`, `all`), each through its own library, from rank 0.

Nothing here needs a network unless the user's settings ask for one: TensorBoard writes
`<output_dir>/tensorboard`; wandb honours `WANDB_MODE=offline` and writes under `<output_dir>/wandb`
(or `WANDB_DIR`); trackio keeps a local database in `TRACKIO_DIR` (default
`~/.cache/huggingface/trackio`) unless `TRACKIO_SPACE_ID` names a Space; mlflow writes to its default
tracking store unless `MLFLOW_TRACKING_URI` says otherwise. A resumed run continues its tracker runs: their ids live in `TrainState.tracker_runs`, saved
in every checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
DEFAULT = "tensorboard"  # grpo_fast's default (TRL and transformers default to "none")


def names(report_to: str) -> list[str]:
    """The trackers `report_to` names (comma-separated; GRPOConfig joins TRL's list form), in TRACKERS
    order; `all`: every installed one. Raises ValueError for an unknown value."""
    given = [v.strip() for v in report_to.split(",") if v.strip()]
    unknown = [v for v in given if v not in (*TRACKERS, "none", "all")]
    if unknown or (len(given) > 1 and {"none", "all"} & set(given)):
        raise ValueError(f"report_to={report_to!r} is not supported; expected a comma-separated list of "
                         f"{list(TRACKERS)}, or 'none' or 'all' alone")
    if "all" in given:
        return [t for t in TRACKERS if _installed(t)]
    return [t for t in TRACKERS if t in given]


def check(report_to) -> None:
    """Before any work: the values are known and every tracker named explicitly is installed (the default
    TensorBoard, when missing, is skipped with a warning at the run's start instead)."""
    missing = [t for t in names(report_to) if not _installed(t) and report_to != DEFAULT]
    if missing:
        raise ValueError(f"report_to={report_to!r} names {missing} but {'it is' if len(missing) == 1 else 'they are'} "
                         f"not installed: pip install {' '.join(missing)}, or leave {missing} out of report_to")


def _installed(tracker: str) -> bool:
    return importlib.util.find_spec(tracker) is not None


def open_trackers(config, runs: dict) -> list:
    """The trackers of `config.report_to`, started (rank 0 only). `runs`: tracker -> run id of this run
    (TrainState.tracker_runs: empty on a fresh run); filled with the ids of the runs started here."""
    out = []
    for name in names(config.report_to):
        if not _installed(name):  # the default TensorBoard only: check() refused the others before work
            logger.warning("report_to=%r: %s is not installed, metrics go to metrics.jsonl only", config.report_to, name)
            continue
        out.append(_OPEN[name](config, runs))
    return out


def _run_name(config) -> str:
    return config.run_name or os.path.basename(os.path.abspath(config.output_dir))


class TensorBoard:
    def __init__(self, config, runs: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(config.output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        pass  # (TensorBoard has no tables; the console shows them)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A wandb run; resumed by id (wandb drops values logged again for a step it has seen: it requires
    increasing steps, so a resumed run keeps what it logged before the interruption for those steps)."""

    def __init__(self, config, runs: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", config.project), name=_run_name(config),
                              id=runs.get("wandb"), resume="allow", config=config.to_dict(),
                              dir=os.environ.get("WANDB_DIR", config.output_dir))
        runs["wandb"] = self.run.id

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        self.run.log({"completions": self.wandb.Table(columns=list(columns), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A trackio run, resumed by name."""

    def __init__(self, config, runs: dict):
        import trackio

        self.trackio = trackio
        # a fresh run starts a new trackio run even where one of its name exists (an earlier run's)
        self.run = trackio.init(project=config.project, name=runs.get("trackio") or _run_name(config),
                                config=config.to_dict(), resume="allow" if "trackio" in runs else "never")
        runs["trackio"] = self.run.name

    def log(self, step: int, metrics: dict) -> None:
        self.trackio.log(metrics, step=step)

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        import pandas as pd

        self.trackio.log({"completions": self.trackio.Table(dataframe=pd.DataFrame(rows, columns=list(columns)))},
                         step=step)

    def close(self) -> None:
        self.trackio.finish()


class MLflow:
    """An mlflow run in the experiment `project` (or MLFLOW_EXPERIMENT_NAME), resumed by run id."""

    def __init__(self, config, runs: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", config.project))
        self.run = mlflow.start_run(run_id=runs.get("mlflow"), run_name=_run_name(config))
        if "mlflow" not in runs:  # (parameters are written once: mlflow refuses to change one)
            params = [(k, str(v)[:500]) for k, v in config.to_dict().items()]
            for start in range(0, len(params), 100):  # (at most 100 per request)
                mlflow.log_params(dict(params[start:start + 100]))
        runs["mlflow"] = self.run.info.run_id

    def log(self, step: int, metrics: dict) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        self.mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(columns)},
                              artifact_file=f"completions/step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


def scalars(record: dict) -> dict:
    """A metrics record's values for a tracker: step and wall time left out, missing values (None) dropped."""
    return {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}


def close_all(trackers: Optional[list]) -> None:
    for tracker in trackers or []:
        try:
            tracker.close()
        except Exception as err:  # a tracker that fails to close loses nothing of the run's own files
            logger.warning("closing %s failed: %s", type(tracker).__name__, err)

"""Where a run's metrics go besides `metrics.jsonl` (always written): `report_to`, with TRL's values
(`tensorboard`, `wandb`, `trackio`, `mlflow`, `none`, `all`), each through its own library, from rank 0.

Nothing here needs a network unless the user's settings ask for one: TensorBoard writes
`<output_dir>/tensorboard`; wandb honours `WANDB_MODE=offline` and writes under `<output_dir>/wandb`
(or `WANDB_DIR`); trackio keeps a local database in `TRACKIO_DIR` (default
`~/.cache/huggingface/trackio`) unless `TRACKIO_SPACE_ID` names a Space; mlflow writes to its default
tracking store unless `MLFLOW_TRACKING_URI` says otherwise. A tracker that logs to a server is checked for
its credentials before any work (`check_credentials`).

A resumed run continues its tracker runs by the ids saved in every checkpoint (`TrainState.tracker_runs`),
never by a run's name, and `catch_up` first logs the steps of metrics.jsonl (up to the resumed step) that
a tracker's run lacks: a kill -9 loses what a tracker had not yet written (wandb's offline file and
trackio's queue lag the run by seconds), so after a resume every tracker holds every step."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable, Optional, Sequence

from .options import ReportOptions

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


def check_credentials(report_to: str) -> None:
    """Before any work (GRPOTrainer calls it before the dataset is read and the model loads, so a refusal
    leaves nothing behind, not even run_config.json): every tracker of `report_to` that logs to a server
    finds what it logs in with. Reads the environment and the trackers' own settings files; no network, so
    a key that the server would refuse is found out when the run starts. Raises a one-line ValueError."""
    for name in names(report_to):
        problem = _LOGIN_PROBLEMS[name]() if name in _LOGIN_PROBLEMS and _installed(name) else None
        if problem:
            raise ValueError(f"report_to={report_to!r}: {problem}")


def _wandb_login_problem() -> Optional[str]:
    """What keeps wandb from logging, as wandb.init would find it: its mode and server from WANDB_* and its
    settings files, then an API key (WANDB_API_KEY, its settings, .netrc) or an identity token file. Read
    into a Settings of our own: `wandb.setup()` or `wandb.login()` would fix the process's wandb settings
    (and the environment they were read from) for every later wandb.init. (wandb 0.31; the .netrc reader is
    wandb's own, so that the file and host match what wandb.init reads; where it moved, the run starts and
    wandb.init decides.)"""
    import wandb

    settings = wandb.Settings()
    config_dir = os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR") or os.path.join("~", ".config", "wandb"))
    try:
        settings.settings_system = os.path.join(config_dir, "settings")
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
    except Exception as err:  # (pydantic's validation error of a bad WANDB_MODE, say: many lines)
        return f"wandb's settings are not valid: {' '.join(str(err).split())}"
    if settings.mode in ("offline", "dryrun", "disabled") or settings.api_key or settings.identity_token_file:
        return None
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth
    except ImportError:
        return None
    try:
        if read_netrc_auth(host=settings.base_url):
            return None
    except Exception:  # an entry that is not a valid key: wandb.init says what is wrong with it
        return None
    return (f"wandb logs online (to {settings.base_url}) but finds no API key: run `wandb login` (or set "
            f"WANDB_API_KEY), or set WANDB_MODE=offline to write the run under <output_dir>/wandb and `wandb sync` "
            f"it later")


def _trackio_login_problem() -> Optional[str]:
    """A Space needs a Hugging Face login, a self-hosted server a write token (trackio's own rules, which its
    init applies after the model loaded); the local database needs nothing."""
    space, server = os.environ.get("TRACKIO_SPACE_ID"), os.environ.get("TRACKIO_SERVER_URL")
    if space:
        import huggingface_hub

        if huggingface_hub.get_token() is None:
            return (f"TRACKIO_SPACE_ID={space!r} logs to a Hugging Face Space, which needs a Hugging Face login: run "
                    f"`hf auth login` (or set HF_TOKEN), or unset TRACKIO_SPACE_ID to log to the local database")
    elif server and "write_token=" not in server and not os.environ.get("TRACKIO_WRITE_TOKEN"):
        return (f"TRACKIO_SERVER_URL={server!r} needs a write token: add ?write_token=... to the URL (as "
                f"`trackio show` prints it) or set TRACKIO_WRITE_TOKEN, or unset TRACKIO_SERVER_URL to log locally")
    return None


# (mlflow: its stores' credentials are many and their own (databricks, tokens, basic auth); it is not checked)
_LOGIN_PROBLEMS: dict[str, Callable[[], Optional[str]]] = {"wandb": _wandb_login_problem,
                                                           "trackio": _trackio_login_problem}


def open_trackers(options: ReportOptions, params: dict, runs: dict, resume_step: int = 0) -> list:
    """The trackers of `options.report_to`, started (rank 0 only). params: the run's options, as each tracker
    records them (GRPOConfig.to_dict()). `runs`: tracker -> run id of this run (TrainState.tracker_runs: empty on
    a fresh run); filled with the ids of the runs started here. resume_step: the step this run resumes at (0: a
    fresh run)."""
    out = []
    for name in names(options.report_to):
        if not _installed(name):  # the default TensorBoard only: check() refused the others before work
            logger.warning("report_to=%r: %s is not installed, metrics go to metrics.jsonl only", options.report_to, name)
            continue
        out.append(_OPEN[name](options, params, runs, resume_step))
    return out


def catch_up(trackers: Sequence, records: list[dict]) -> None:
    """After a resume: each tracker logs the values of `records` (metrics.jsonl up to the resumed step, in
    order) that its run does not hold, as they were logged. A tracker says what it holds (`held`); one that
    cannot be read back is left as it is, with a warning (the run's own files hold every step anyway)."""
    for tracker in trackers if records else ():
        try:
            held = tracker.held(records)
        except Exception as err:
            logger.warning("%s: could not read back what its run holds (%s): steps a kill lost stay lost there",
                           type(tracker).__name__, " ".join(str(err).split()))
            continue
        for record in records:
            values = {k: v for k, v in scalars(record).items() if k not in held.get(record["step"], ())}
            if values:
                tracker.log(record["step"], values)


def _run_name(options: ReportOptions) -> str:
    return options.run_name or os.path.basename(os.path.abspath(options.output_dir))


class TensorBoard:
    """Event files in `<output_dir>/tensorboard`, flushed at every step (so a kill loses at most the step
    being written). A resumed run's writer hides what an interrupted attempt logged past the resumed step
    (`purge_step`: TensorBoard's own rule for a restart; that step is trained and logged again)."""

    def __init__(self, options: ReportOptions, params: dict, runs: dict, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(options.output_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=resume_step + 1)

    def held(self, records: list[dict]) -> dict[int, set]:
        """step -> the names this folder's event files hold at that step (read as TensorBoard reads them)."""
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

        events = EventAccumulator(self.log_dir, size_guidance={SCALARS: 0})  # (0: every event, none sampled away)
        events.Reload()
        out: dict[int, set] = {}
        for tag in events.Tags()[SCALARS]:
            for event in events.Scalars(tag):
                out.setdefault(event.step, set()).add(tag)
        return out

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        pass  # (TensorBoard has no tables; the console shows them)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A wandb run; resumed by id (wandb drops values logged again for a step below its last one: it
    requires increasing steps, so a resumed online run keeps what it logged before the interruption for those
    steps, and since a resume is exact they are the same values)."""

    def __init__(self, options: ReportOptions, params: dict, runs: dict, resume_step: int = 0):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", options.project), name=_run_name(options),
                              id=runs.get("wandb"), resume="allow", config=params,
                              dir=os.environ.get("WANDB_DIR", options.output_dir))
        runs["wandb"] = self.run.id

    def held(self, records: list[dict]) -> dict[int, set]:
        """The steps below the run's next step (online: where the server's history of a resumed run goes on).
        Offline, an attempt's history is its own file, which wandb sync joins to the others: 0, so the resumed
        attempt's file holds every step (the killed one's may hold none: wandb writes it seconds late)."""
        try:
            next_step = self.run.step
        except Exception:  # (mode="shared" runs have no step of their own)
            next_step = 0
        return {r["step"]: set(scalars(r)) for r in records if r["step"] < next_step}

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        self.run.log({"completions": self.wandb.Table(columns=list(columns), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A trackio run, continued by the id the checkpoint saved (runs["trackio"]: {"id", "name"}), never
    looked up by its name: two output folders of the same basename (a/r and b/r; two projects' default
    outputs/grpo_fast) give runs of the same name."""

    def __init__(self, options: ReportOptions, params: dict, runs: dict, resume_step: int = 0):
        import trackio

        self.trackio, self.project = trackio, options.project
        saved = runs.get("trackio")
        if saved is not None and not isinstance(saved, dict):
            # (a checkpoint written before runs had ids here saved a name: a new run, which catch_up fills in)
            logger.warning("the checkpoint names its trackio run %r by name only: continuing in a new trackio run", saved)
            saved = None
        self.run = _trackio_run(trackio, options.project, saved["name"] if saved else _run_name(options), params,
                                saved["id"] if saved else None)
        runs["trackio"] = {"id": self.run.id, "name": self.run.name}

    def held(self, records: list[dict]) -> dict[int, set]:
        """step -> the names the run holds at that step, from the local database. A Space or a server cannot
        be read back here: their runs are taken to hold every step (a kill may have lost the last second of
        them)."""
        if self.run.url is not None:
            return {r["step"]: set(scalars(r)) for r in records}
        from trackio.sqlite_storage import SQLiteStorage

        out: dict[int, set] = {}
        for row in SQLiteStorage.get_logs(self.project, self.run.name, run_id=self.run.id):
            out.setdefault(row["step"], set()).update(k for k in row if k not in ("step", "timestamp"))
        return out

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, columns: Sequence[str], rows: list[list]) -> None:
        import pandas as pd

        self.run.log({"completions": self.trackio.Table(dataframe=pd.DataFrame(rows, columns=list(columns)))}, step=step)

    def close(self) -> None:
        self.trackio.finish()


def _trackio_run(trackio, project: str, name: str, params: dict, run_id: Optional[str]):
    """trackio's run `run_id` of `project` under `name` (None: a new run). trackio 0.43's `init` resumes a
    run by name only (the newest run of that name, whichever folder it came from); its runs have had ids
    since gradio-app/trackio#505, and every record a run logs carries its id. So the run is started as a new
    one under its name and given back its saved id before it logs anything: what it logs joins that run and
    no other. (Goes when trackio's `init` takes an id.)"""
    run = trackio.init(project=project, name=name, config=params, resume="never")
    if run_id is not None:
        run.id = run_id
    return run


class MLflow:
    """An mlflow run in the experiment `project` (or MLFLOW_EXPERIMENT_NAME), resumed by run id. Each call
    writes through to its store, so a kill loses at most the call in progress: it is taken to hold every step
    (not replayed: mlflow keeps a value logged twice at a step twice)."""

    def __init__(self, options: ReportOptions, params: dict, runs: dict, resume_step: int = 0):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", options.project))
        self.run = mlflow.start_run(run_id=runs.get("mlflow"), run_name=_run_name(options))
        if "mlflow" not in runs:  # (parameters are written once: mlflow refuses to change one)
            shown = [(k, str(v)[:500]) for k, v in params.items()]
            for start in range(0, len(shown), 100):  # (at most 100 per request)
                mlflow.log_params(dict(shown[start:start + 100]))
        runs["mlflow"] = self.run.info.run_id

    def held(self, records: list[dict]) -> dict[int, set]:
        return {r["step"]: set(scalars(r)) for r in records}

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

"""`ReportOptions`: what a run reports and where (metrics.py, trackers.py, completions_table.py read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..bounds import INTEGER_AT_LEAST_1
from ..options import mirror, option, options_record


@options_record
@dataclass(frozen=True)
class ReportOptions:
    """What a run reports and where: metrics.jsonl's steps, the trackers (trackers.py), the completions table
    (completions_table.py) and the progress bar."""

    output_dir: str = mirror("outputs/grpo_fast")
    logging_steps: int = option(1, "Write metrics every this many steps.", bounds=INTEGER_AT_LEAST_1)
    max_steps: int = mirror(20)  # (the last step is always logged)
    report_to: str = option("tensorboard", "Where metrics go besides metrics.jsonl (always written), comma-separated (TRL's values): tensorboard (<output_dir>/tensorboard), wandb (WANDB_MODE=offline works without a network), trackio (a local database unless TRACKIO_SPACE_ID is set), mlflow, or none, or all (every one installed). The default is tensorboard; TRL and transformers default to none. A tracker named here that is not installed is refused before any work. Many ranks: rank 0 reports. A resumed run continues its tracker runs.")
    run_name: Optional[str] = option(None, "The run's name in wandb, trackio and mlflow. None: the output folder's name.")
    project: str = option("grpo_fast", "The project of the run in trackio and wandb (WANDB_PROJECT wins there) and mlflow's experiment (MLFLOW_EXPERIMENT_NAME wins there).")
    log_completions: bool = option(False, "At each logged step that starts a generation batch, show a table of sampled completions (prompt, completion, each reward, the advantage): in the console and, as a table, in wandb, trackio and mlflow.")
    num_completions_to_print: Optional[int] = option(None, "Rows of the log_completions table. None: every completion of the generation batch (over all ranks).", bounds=INTEGER_AT_LEAST_1)
    disable_tqdm: bool = option(False, "Turn off the live progress bar.")

"""`log_completions`: a table of what the model wrote — prompt, completion, each reward, the advantage
(TRL's columns) — for a generation batch, in the console (a rich table) and in the trackers that show
tables (wandb, trackio, mlflow). Rank 0 shows every rank's completions."""

from __future__ import annotations

import math

from .distributed import gather_objects
from .metrics import logs_step
from .rewards.registry import reward_name


def table_rows(batch, reward_funcs, prompt_column: str) -> tuple[list[str], list[list]]:
    """(columns, rows) of a scored batch with its advantages: one row per completion, rewards as scored
    (None where a function gave none)."""
    names = [reward_name(f) for f in reward_funcs]
    rows = []
    for i in range(len(batch)):
        rewards = [None if math.isnan(v) else float(v) for v in batch.rewards[i].tolist()]
        rows.append([_text(batch.rows[i][prompt_column]), batch.completion_texts[i], *rewards,
                     float(batch.advantages[i])])
    return ["prompt", "completion", *names, "advantage"], rows


def _text(prompt) -> str:
    """A prompt as text; a conversation as its messages' contents, one per line."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def render(columns: list[str], rows: list[list], step: int):
    """The console's table (rich): rewards and the advantage to 3 decimals."""
    from rich.table import Table

    table = Table(title=f"completions at step {step}", show_lines=True)
    for name in columns:
        table.add_column(name, justify="right" if name not in ("prompt", "completion") else "left")
    for row in rows:
        table.add_row(*(v if isinstance(v, str) else "-" if v is None else f"{v:.3f}" for v in row))
    return table


def log_completions(batch, *, step: int, config, reward_funcs, world, bar, metrics_logger) -> None:
    """At a logged step, when `config.log_completions`: the table of `batch` (the generation batch) on
    rank 0's console and trackers, `num_completions_to_print` rows (None: all). Every rank calls it."""
    if not (config.log_completions and logs_step(step, config)):
        return
    columns, rows = table_rows(batch, reward_funcs, config.prompt_column)
    rows = [row for part in gather_objects(rows, world) for row in part][: config.num_completions_to_print]
    if world.main:
        bar.print(render(columns, rows, step))
        metrics_logger.log_table(step, columns, rows)

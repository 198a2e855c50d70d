"""`log_completions`: a table of what the model wrote — prompt, completion, each reward, the advantage
(TRL's columns) — for a generation batch, in the console (a rich table) and in the trackers that show
tables (wandb, trackio, mlflow). Rank 0 shows every rank's completions.

Model text is data: it is shown as written, never read as markup (rich's `[bold]`, `[/INST]`,
`:smile:`), and the characters that would act on the terminal or cannot be encoded (control bytes,
lone surrogates, bidirectional overrides) are shown as their escapes (`\\x1b`, `\\ud800`, `\\u202e`).
The trackers get the same escaped text as the console.
"""

from __future__ import annotations

import math
import re

from ..distributed import gather_objects
from ..rewards.names import reward_name
from .metrics import logs_step
from .options import ReportOptions


def table_rows(batch, reward_funcs, prompt_column: str) -> tuple[list[str], list[list]]:
    """(columns, rows) of a scored batch with its advantages: one row per completion, rewards as scored
    (None where a function gave none)."""
    names = [reward_name(f) for f in reward_funcs]
    rows = []
    for i in range(len(batch)):
        rewards = [None if math.isnan(v) else float(v) for v in batch.rewards[i].tolist()]
        rows.append([shown(_text(batch.rows[i][prompt_column])), shown(batch.completion_texts[i]), *rewards,
                     float(batch.advantages[i])])
    return ["prompt", "completion", *names, "advantage"], rows


# C0 and C1 control characters but newline and tab (a table cell keeps its lines), DEL, lone surrogates
# (stdout's UTF-8 and the trackers' JSON cannot encode them), and the bidirectional embeddings, overrides and
# isolates (they reorder what the terminal shows around them)
_UNSHOWABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> str:
    """`text` as a table shows it: every character that would act on the terminal, or that cannot be
    encoded, replaced by its Python escape (`\\x1b`, `\\r`, `\\ud800`); the rest as written (a backslash in
    the text stays one backslash: LaTeX answers read as written)."""
    return _UNSHOWABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def _text(prompt) -> str:
    """A prompt as text; a conversation as its messages' contents, one per line."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def render(columns: list[str], rows: list[list], step: int):
    """The console's table (rich): text cells and headers as `Text` (never parsed as markup: a reward
    name is a function or folder name, which may hold brackets too), rewards and the advantage to 3 decimals."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"completions at step {step}", show_lines=True)
    for name in columns:
        table.add_column(Text(shown(name)), justify="right" if name not in ("prompt", "completion") else "left")
    for row in rows:
        table.add_row(*(Text(shown(v)) if isinstance(v, str) else "-" if v is None else f"{v:.3f}" for v in row))
    return table


def log_completions(batch, *, step: int, options: ReportOptions, prompt_column: str, reward_funcs, world, bar,
                    metrics_logger) -> None:
    """At a logged step, when `options.log_completions`: the table of `batch` (the generation batch) on
    rank 0's console and trackers, `num_completions_to_print` rows (None: all). Every rank calls it."""
    if not (options.log_completions and logs_step(step, options)):
        return
    columns, rows = table_rows(batch, reward_funcs, prompt_column)
    rows = [row for part in gather_objects(rows, world) for row in part][: options.num_completions_to_print]
    if world.main:
        bar.print(render(columns, rows, step))
        metrics_logger.log_table(step, columns, rows)

"""Prompt datasets: load rows from files, saved HF datasets or built-in tasks; encode prompts.

A row is a dict with a prompt column (a string, or a list of chat messages ``{"role", "content"}``)
and any other columns (``answer``, ...) that pass through to the reward functions.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Optional

logger = logging.getLogger(__name__)

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


# ----------------------------------------------------------------------------- loading


def load_dataset_rows(source, *, split: str = "train", prompt_column: str = "prompt") -> list[dict]:
    """Rows of a prompt dataset, checked to have a usable prompt column.

    Args:
        source: one of
            - a ``.jsonl`` / ``.json`` / ``.parquet`` file (``split`` is ignored: the file is the split);
              a ``.json`` file holds a list of rows, or an object mapping split names to lists;
            - a folder written by HF ``datasets`` ``save_to_disk`` (a ``DatasetDict`` is indexed by ``split``);
            - a folder holding ``<split>.jsonl`` / ``<split>.json`` / ``<split>.parquet``;
            - a built-in task name: ``"arithmetic"`` or ``"arithmetic:<n>"`` (n rows; see ``tasks.py``).
        split: which split to read where the source has several (``"train"``, ``"test"``).
        prompt_column: the column holding the prompt.

    Returns:
        list of dicts, one per row, in file order.

    Raises:
        FileNotFoundError: the path does not exist (naming it).
        ValueError: malformed JSON/JSONL (naming the path, line and column), a file that is not
            UTF-8 (naming the path, line and column), an empty dataset, a missing prompt column
            (naming it and the columns found), a prompt that is neither a string nor a list of
            messages, or a blank prompt (naming the row).
    """
    from .tasks import BUILTIN_TASKS, task_rows

    source_str = os.fspath(source)
    if source_str.split(":", 1)[0] in BUILTIN_TASKS and not os.path.exists(source_str):
        rows, where = task_rows(source_str, split=split), f"built-in task {source_str!r} (split {split!r})"
    else:
        rows, where = _read_source(source_str, split), source_str
    check_rows(rows, prompt_column=prompt_column, where=where)
    return rows


def _read_source(path: str, split: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset: no such file or folder: {path!r}")
    if os.path.isdir(path):
        return _read_folder(path, split)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path, split)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"dataset {path!r}: expected a file ending in one of {_FILE_SUFFIXES} or a folder, got {suffix!r}")


def _read_folder(path: str, split: str) -> list[dict]:
    # A folder from `datasets.save_to_disk` has dataset_info.json (Dataset) or dataset_dict.json.
    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(
        os.path.join(path, "dataset_info.json")
    ):
        return _read_saved_hf_dataset(path, split)
    for suffix in _FILE_SUFFIXES:
        candidate = os.path.join(path, split + suffix)
        if os.path.exists(candidate):
            return _read_source(candidate, split)
    raise ValueError(
        f"dataset folder {path!r}: expected a folder saved by datasets.save_to_disk or a file "
        f"{split}{{{','.join(_FILE_SUFFIXES)}}} for split {split!r}; found {sorted(os.listdir(path))}"
    )


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate, found below with its line
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, start=1):
            _check_utf8(path, line, line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # e.colno counts from the last newline before the error: an error at the end of the
                # line (a missing '}') lands after the line's own '\n' and reads as column 1.
                column = min(e.pos, len(line.rstrip("\r\n"))) + 1
                raise ValueError(
                    f"dataset {path!r}, line {line_no}: malformed JSON ({e.msg} at column {column})"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"dataset {path!r}, line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # the bytes surrogateescape could not decode


def _check_utf8(path: str, text: str, first_line: int = 1) -> None:
    """Raise ValueError naming the line and column of the first byte of ``text`` that is not UTF-8."""
    bad = _NOT_UTF8.search(text)
    if bad is None:
        return
    start = bad.start()
    line_no = first_line + text.count("\n", 0, start)
    column = start - text.rfind("\n", 0, start)
    raise ValueError(
        f"dataset {path!r}, line {line_no}, column {column}: byte 0x{ord(bad.group()) - 0xDC00:02x} is not "
        f"valid UTF-8; the file must be UTF-8 encoded (re-save it as UTF-8)"
    )


def _read_json(path: str, split: str) -> list[dict]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read()
    _check_utf8(path, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several documents: JSON lines saved as .json
            return _read_jsonl(path)
        line_no, column, where = e.lineno, e.colno, ""
        end = len(text.rstrip())
        if e.pos >= end:  # the text ended early: point just past its last character, not at the next line
            line_no, column, where = text.count("\n", 0, end) + 1, end - text.rfind("\n", 0, end), ", end of file"
        raise ValueError(
            f"dataset {path!r}, line {line_no}: malformed JSON ({e.msg} at column {column}{where})"
        ) from None
    if isinstance(data, dict):
        if split not in data:
            raise ValueError(
                f"dataset {path!r}: a JSON object must map split names to row lists; no split {split!r} in {sorted(data)}"
            )
        data = data[split]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"dataset {path!r}: expected a list of JSON objects (rows)")
    return data


def _read_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"dataset {path!r}: reading parquet needs the `pyarrow` package (pip install pyarrow)"
        ) from None
    return pq.read_table(path).to_pylist()


def _read_saved_hf_dataset(path: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"dataset {path!r}: reading a saved HF dataset needs the `datasets` package (pip install datasets)"
        ) from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"dataset {path!r}: no split {split!r}; splits found: {sorted(ds)}")
        ds = ds[split]
    return ds.to_list()


# ----------------------------------------------------------------------------- checking


def _is_messages(prompt) -> bool:
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def _is_blank(content) -> bool:
    """No text: None, an empty or whitespace-only string, or an empty list (of content parts)."""
    return content is None or (isinstance(content, str) and not content.strip()) or content == []


def check_rows(rows: Sequence[dict], *, prompt_column: str = "prompt", where: str = "dataset") -> None:
    """Raise ValueError unless ``rows`` is non-empty and every row has a non-blank string or
    chat-message prompt (a message list needs at least one message with non-blank content)."""
    if len(rows) == 0:
        raise ValueError(f"{where}: the dataset is empty (0 rows)")
    for i, row in enumerate(rows):
        if prompt_column not in row:
            raise ValueError(
                f"{where}: row {i} has no prompt column {prompt_column!r}; columns found: {sorted(row)} "
                f"(choose the column with prompt_column=...)"
            )
        prompt = row[prompt_column]
        if not (isinstance(prompt, str) or _is_messages(prompt)):
            raise ValueError(
                f"{where}: row {i}, column {prompt_column!r}: expected a string or a non-empty list of "
                f'{{"role", "content"}} messages, got {type(prompt).__name__}: {str(prompt)[:80]!r}'
            )
        if isinstance(prompt, str) and _is_blank(prompt):
            raise ValueError(
                f"{where}: row {i}, column {prompt_column!r}: the prompt is empty ({prompt!r}); "
                f"expected non-blank text (drop or fill the row)"
            )
        if isinstance(prompt, list) and all(_is_blank(m["content"]) for m in prompt):
            raise ValueError(
                f"{where}: row {i}, column {prompt_column!r}: every message's content is empty; "
                f"expected at least one message with non-blank content (drop or fill the row)"
            )


# ----------------------------------------------------------------------------- encoding


def prompt_to_text(prompt, tokenizer, *, tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None
                   ) -> tuple[str, bool]:
    """The text the model sees for one prompt, and whether it carries its own special tokens.

    A message list goes through the tokenizer's chat template (with the generation prompt); so does a
    string when the tokenizer has a template (as a single user message). Otherwise a string is used as is.
    tools: their JSON schemas, rendered by the template (agents); chat_template_kwargs: the template's extra
    arguments.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str) and not has_template:
        return prompt, False
    if not has_template:
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat_template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools or None,
                                         **(chat_template_kwargs or {})), True


def encode_prompts(
    rows: Sequence[dict],
    tokenizer,
    *,
    prompt_column: str = "prompt",
    max_prompt_length: int | None = None,
    truncation: str = "left",
    tools: Optional[list] = None,
    chat_template_kwargs: Optional[dict] = None,
) -> tuple[list[list[int]], list[str], int]:
    """Token ids of each row's prompt, chat template applied where it applies.

    Args:
        rows: N rows with a prompt column (string or chat messages).
        tokenizer: a transformers tokenizer.
        max_prompt_length: keep at most this many tokens per prompt (None: no limit).
        truncation: ``"left"`` drops the oldest tokens of a long prompt (keeping the generation
            prompt at the end) and logs a warning; ``"error"`` raises instead.
        tools, chat_template_kwargs: handed to the chat template (`prompt_to_text`).

    Returns:
        ``(ids, texts, n_truncated)``: ids, N lists of token ids; texts, N strings decoded from those
        ids (special tokens kept, so they show what the model saw, truncation included);
        n_truncated, how many prompts were cut.
    """
    if truncation not in ("left", "error"):
        raise ValueError(f"truncation: expected 'left' or 'error', got {truncation!r}")
    if max_prompt_length is not None and (not isinstance(max_prompt_length, int) or max_prompt_length < 1):
        raise ValueError(f"max_prompt_length: expected a positive int or None, got {max_prompt_length!r}")
    check_rows(rows, prompt_column=prompt_column, where="encode_prompts")

    all_ids, n_truncated, longest = [], 0, 0
    for i, row in enumerate(rows):
        text, templated = prompt_to_text(row[prompt_column], tokenizer, tools=tools,
                                         chat_template_kwargs=chat_template_kwargs)
        # A chat template writes its own BOS/markers: adding special tokens again would double them.
        ids = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"encode_prompts: row {i} prompt has {len(ids)} tokens > max_prompt_length={max_prompt_length} "
                    f"(raise max_prompt_length or use truncation='left')"
                )
            longest = max(longest, len(ids))
            ids = ids[-max_prompt_length:]
            n_truncated += 1
        all_ids.append(ids)
    if n_truncated:
        logger.warning(
            "%d of %d prompts were longer than max_prompt_length=%d (longest %d tokens): truncated from the left",
            n_truncated,
            len(rows),
            max_prompt_length,
            longest,
        )
    texts = tokenizer.batch_decode(all_ids, skip_special_tokens=False)
    return all_ids, texts, n_truncated

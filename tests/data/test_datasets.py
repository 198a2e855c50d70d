"""Loading prompt datasets from files and folders, with the errors a user meets."""

from __future__ import annotations

import json

import pytest

from grpo_fast.data import check_rows, load_dataset_rows

ROWS = [
    {"prompt": "What is 1 + 1?", "answer": "2"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
        "answer": "5",
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_dataset_rows(path) == ROWS
    assert load_dataset_rows(str(path)) == ROWS


def test_json_list_and_split_mapping(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    assert load_dataset_rows(tmp_path / "list.json") == ROWS
    (tmp_path / "splits.json").write_text(json.dumps({"train": ROWS, "test": ROWS[:1]}))
    assert load_dataset_rows(tmp_path / "splits.json", split="test") == ROWS[:1]
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_dataset_rows(tmp_path / "splits.json", split="dev")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_dataset_rows(tmp_path / "d.parquet", prompt_column="question") == rows


def test_saved_hf_dataset_and_split_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(tmp_path / "hf"))
    assert load_dataset_rows(tmp_path / "hf", split="test") == rows[:1]
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_dataset_rows(tmp_path / "hf", split="dev")
    # a plain folder of <split>.jsonl files
    write_jsonl(tmp_path / "train.jsonl", rows)
    assert load_dataset_rows(tmp_path, split="train") == rows


def test_malformed_jsonl_names_path_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 3: malformed JSON"):
        load_dataset_rows(path)


def test_malformed_jsonl_column_points_into_the_line(tmp_path):
    # json.loads reports an error at the end of a line (missing '}') as column 1 of the next line
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"line 2: malformed JSON \(Expecting ',' delimiter at column 15\)$"):
        load_dataset_rows(path)
    path.write_text('{"prompt": "a"}\n  {"prompt": tru}\n')  # column of the 't' of 'tru'
    with pytest.raises(ValueError, match=r"line 2: malformed JSON \(Expecting value at column 14\)$"):
        load_dataset_rows(path)
    (tmp_path / "bad.json").write_text('[\n  {"prompt": "a"}\n')  # a .json cut short
    with pytest.raises(ValueError, match=r"bad\.json', line 2: malformed JSON \(.* at column 18, end of file\)$"):
        load_dataset_rows(tmp_path / "bad.json")


def test_non_utf8_file_names_path_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "ok"}\n{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"latin1\.jsonl', line 2, column 16: byte 0xe9 is not valid UTF-8; the file must be UTF-8"
    ):
        load_dataset_rows(path)
    path = tmp_path / "latin1.json"
    path.write_bytes('[\n {"prompt": "ok"},\n {"prompt": "café"}\n]\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.json', line 3, column 17: byte 0xe9 is not valid UTF-8"):
        load_dataset_rows(path)


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("", r"row 1, column 'prompt': the prompt is empty \(''\); expected non-blank text"),
        (" \n\t", r"row 1, column 'prompt': the prompt is empty \(' \\n\\t'\); expected non-blank text"),
        (
            [{"role": "system", "content": ""}, {"role": "user", "content": "  "}],
            r"row 1, column 'prompt': every message's content is empty; expected at least one message",
        ),
    ],
)
def test_blank_prompt_refused_at_load(tmp_path, prompt, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=r"d\.jsonl: " + expected):
        load_dataset_rows(path)
    with pytest.raises(ValueError, match="^train_dataset: " + expected):
        check_rows([{"prompt": "ok"}, {"prompt": prompt}], where="train_dataset")
    # one non-blank message is enough (an empty system prompt is fine)
    check_rows([{"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]}])


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset_rows(tmp_path / "nope.jsonl")


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'; columns found: \['answer', 'question'\]"):
        load_dataset_rows(path)


def test_bad_prompt_type_and_empty(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": 3}])
    with pytest.raises(ValueError, match="row 1, column 'prompt': expected a string or"):
        load_dataset_rows(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_dataset_rows(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="expected a file ending in"):
        (tmp_path / "d.csv").write_text("prompt\nx\n")
        load_dataset_rows(tmp_path / "d.csv")


def test_builtin_task_by_name():
    rows = load_dataset_rows("arithmetic:7", split="test")
    assert len(rows) == 7 and all(isinstance(r["prompt"], str) and r["answer"] for r in rows)

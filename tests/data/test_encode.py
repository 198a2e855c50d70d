"""encode_prompts: chat templates, plain text, left truncation, against a tiny byte-level tokenizer."""

from __future__ import annotations

import logging

import pytest

from grpo_fast.data import encode_prompts
from tests.tiny_model import build_tiny_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    return tok


def test_chat_template_for_messages_and_strings(chat_tokenizer):
    rows = [
        {"prompt": "What is 1 + 1?"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ]
    ids, texts, n_truncated = encode_prompts(rows, chat_tokenizer)
    assert n_truncated == 0
    # a string is wrapped as one user message; the generation prompt ends every prompt
    assert texts[0] == "<s>user\nWhat is 1 + 1?</s>\n<s>assistant\n"
    assert texts[1] == "<s>system\nBe brief.</s>\n<s>user\nHi</s>\n<s>assistant\n"
    # no BOS added on top of the template's own
    bos = chat_tokenizer.bos_token_id
    assert ids[0][0] == bos and ids[0][1] != bos
    assert ids[0] == chat_tokenizer(texts[0], add_special_tokens=False)["input_ids"]


def test_plain_text_without_template(plain_tokenizer):
    ids, texts, _ = encode_prompts([{"q": "abc"}], plain_tokenizer, prompt_column="q")
    assert plain_tokenizer.decode(ids[0], skip_special_tokens=True) == "abc" and texts[0].endswith("abc")
    with pytest.raises(ValueError, match="no chat_template"):
        encode_prompts([{"prompt": [{"role": "user", "content": "x"}]}], plain_tokenizer)


def test_left_truncation_keeps_the_end(chat_tokenizer, caplog):
    rows = [{"prompt": "x" * 40}, {"prompt": "short"}]
    full, _, _ = encode_prompts(rows, chat_tokenizer)
    with caplog.at_level(logging.WARNING):
        ids, texts, n_truncated = encode_prompts(rows, chat_tokenizer, max_prompt_length=30)
    assert n_truncated == 1 and "truncated from the left" in caplog.text
    assert len(full[0]) > 30 and ids[0] == full[0][-30:]
    assert ids[1] == full[1]  # 24 tokens: untouched
    assert texts[0].endswith("<s>assistant\n") and texts[0] == chat_tokenizer.decode(full[0][-30:])


def test_truncation_error_names_row_and_lengths(chat_tokenizer):
    rows = [{"prompt": "ok"}, {"prompt": "y" * 40}]
    with pytest.raises(ValueError, match=r"row 1 prompt has \d+ tokens > max_prompt_length=30"):
        encode_prompts(rows, chat_tokenizer, max_prompt_length=30, truncation="error")
    with pytest.raises(ValueError, match="truncation"):
        encode_prompts(rows, chat_tokenizer, truncation="right")

"""Token exactness: the running ids of a trajectory equal `apply_chat_template(messages)` token for token over
3+ turns, for the shipped template (SmolLM2's tokenizer) and a second prefix-preserving one (the tiny ChatML
tokenizer); a sampled turn is kept verbatim; templates that cannot serve are refused before any work."""

import pytest

from grpo_fast.generation.agents.builtin import calculator
from grpo_fast.generation.agents.chat import MAX_ARGUMENT_NESTING, TOOL_CHAT_TEMPLATE, ChatTemplate
from grpo_fast.generation.agents.tools import as_tools
from tests.agents.tool_model import TOOLS, build_chatml_tokenizer


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from grpo_fast.models.loading import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation(tool_names):
    a, b = tool_names[0], tool_names[-1]
    return [
        {"role": "user", "content": "What is (3 + 4) * 2?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(a, expression="3 + 4")]},
        {"role": "tool", "name": a, "content": "7"},
        {"role": "assistant", "content": "Now the product.", "tool_calls": [_call(b, expression="7 * 2"),
                                                                            _call(a, expression="14")]},
        {"role": "tool", "name": b, "content": "14"},
        {"role": "tool", "name": a, "content": "14"},
        {"role": "assistant", "content": "The answer is 14."},
    ]


def _running_ids(chat: ChatTemplate, messages):
    """What the loop builds: the prompt's rendering, each assistant turn as sampled (the template's rendering of
    it up to its end-of-turn token), the ids between turns for the tool messages."""
    ids = chat.render(messages[:1], generation_prompt=True)
    k = 1
    while k < len(messages):
        full = chat.render(messages[: k + 1], generation_prompt=False)
        turn = full[len(ids):]
        turn = turn[: max(i for i, t in enumerate(turn) if t == chat.end_of_turn) + 1]  # as sampled: ends at <|im_end|>
        _, calls, malformed = chat.parse(turn, ids)
        assert not malformed
        assert [c["name"] for c in calls] == [c["function"]["name"] for c in messages[k].get("tool_calls", [])]
        ids = ids + turn
        k += 1
        tools = []
        while k < len(messages) and messages[k]["role"] == "tool":
            tools.append(messages[k])
            k += 1
        if tools:
            ids = ids + chat.between_turns(tools)
    return ids


def test_shipped_template_running_ids_equal_the_rendering(smollm_tokenizer):
    chat = ChatTemplate(smollm_tokenizer, as_tools([calculator]))
    assert chat.source == "grpo_fast's ChatML tool template" and smollm_tokenizer.chat_template == TOOL_CHAT_TEMPLATE
    messages = _conversation(["calculator"])
    ids = _running_ids(chat, messages)
    expected = chat.render(messages, generation_prompt=False)
    assert ids == expected[: len(ids)] and expected[len(ids):] == smollm_tokenizer.encode("\n", add_special_tokens=False)
    assert chat.render(messages[:1], generation_prompt=True) == smollm_tokenizer.apply_chat_template(
        messages[:1], tools=chat.schemas, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_second_template_running_ids_equal_the_rendering():
    tokenizer = build_chatml_tokenizer()
    chat = ChatTemplate(tokenizer, as_tools(TOOLS))
    assert chat.source == "the tokenizer's chat template"
    messages = _conversation(["add", "mul"])
    for m in messages:  # this template's tools take a and b
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = {"a": 1, "b": 2}
    ids = _running_ids(chat, messages)
    expected = chat.render(messages, generation_prompt=False)
    assert ids == expected[: len(ids)] and len(expected) - len(ids) == 1  # (the "\n" after the last <|im_end|>)


def test_a_non_canonical_turn_is_parsed_and_kept_verbatim():
    """The tiny tokenizer encodes <tool_call> as one added token; a model may sample it byte by byte instead. The
    call parses from the text, and the running ids hold the sampled ids, not their re-encoding."""
    tokenizer = build_chatml_tokenizer()
    chat = ChatTemplate(tokenizer, as_tools(TOOLS))
    prompt = chat.render([{"role": "user", "content": "1+2?"}], generation_prompt=True)
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    canonical = tokenizer.encode(text, add_special_tokens=False)
    byte_wise = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
    assert byte_wise != canonical and tokenizer.decode(byte_wise) == tokenizer.decode(canonical)
    turn = byte_wise + [chat.end_of_turn]
    content, calls, malformed = chat.parse(turn, prompt)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}] and not malformed and content == ""


def test_malformed_markup_is_flagged():
    tokenizer = build_chatml_tokenizer()
    chat = ChatTemplate(tokenizer, as_tools(TOOLS))
    prompt = chat.render([{"role": "user", "content": "1+2?"}], generation_prompt=True)
    end = [chat.end_of_turn]
    assert chat.parse(tokenizer.encode("<tool_call>{not json</tool_call>", add_special_tokens=False) + end, prompt) \
        == ("<tool_call>{not json</tool_call>", [], True)
    assert chat.parse(tokenizer.encode("3", add_special_tokens=False) + end, prompt) == ("3", [], False)
    # brackets nested past Python's recursion limit (JSON parses them; repairing or copying them recursed out of
    # the loop, ending the run): a malformed call; within MAX_ARGUMENT_NESTING, an ordinary one
    for depth, expected in ((600, True), (MAX_ARGUMENT_NESTING - 1, False)):
        text = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * depth + "]" * depth + ', "b": 2}}</tool_call>'
        _, calls, malformed = chat.parse(tokenizer.encode(text, add_special_tokens=False) + end, prompt)
        assert malformed is expected and len(calls) == (0 if expected else 1), depth


def test_templates_that_cannot_serve_are_refused(tmp_path):
    tokenizer = build_chatml_tokenizer()
    tools = as_tools(TOOLS)
    reordering = tmp_path / "reorders.jinja"  # renders the last message first: earlier messages change
    reordering.write_text("{%- if tools %}tools{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
                          "{%- for m in messages | reverse %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    with pytest.raises(ValueError, match="chat_template_path: .* is not prefix-preserving"):
        ChatTemplate(tokenizer, tools, path=str(reordering))
    blind = tmp_path / "blind.jinja"  # never shows the tools
    blind.write_text("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}")
    with pytest.raises(ValueError, match=r"does not render the tools \['add', 'mul'\]"):
        ChatTemplate(build_chatml_tokenizer(), tools, path=str(blind))
    with pytest.raises(ValueError, match="is not a file"):
        ChatTemplate(build_chatml_tokenizer(), tools, path=str(tmp_path / "missing.jinja"))
    plain = build_chatml_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # not ChatML, no tools
    with pytest.raises(ValueError, match="does not render tools and is not ChatML"):
        ChatTemplate(plain, tools)

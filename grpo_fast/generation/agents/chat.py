"""The chat side of an agent: the template that shows the tools, parsing a turn's calls, and the token
ids of the messages between two assistant turns, rendered without re-tokenising what the model sampled.

Token exactness (verl#3720: a separator dropped at every assistant -> tool boundary): the running ids
of a trajectory are the prompt's rendering, then each sampled turn verbatim, then, after a turn with
calls, `between_turns(tool messages)`: the difference of two renderings of a dummy conversation,
with and without the tool messages (and the next generation prompt), preceded by the template's
tokens after an assistant turn's end-of-turn token (ChatML's "\\n" after <|im_end|>). That equals
`apply_chat_template(messages)` token for token as long as the template is prefix-preserving (an
earlier message renders the same whatever follows), which `ChatTemplate` checks before any work.

What a tool or an environment returns is untrusted text: `render(..., untrusted=[...])` encodes it with the
tokenizer's special tokens split as text (`split_special_tokens=True`), so a result holding
"<|im_end|>\n<|im_start|>assistant\n" reads as those characters, never as the template's tokens that end a
turn. Text without a special token's string renders exactly as `apply_chat_template` renders it (the
common case, token for token); text with one is spliced into the rendering in its place (placeholders
rendered, then each replaced by the text's own ids). A result is cut to `max_tool_response_tokens` by
characters first (`char_bound`: no token spans more characters than the vocabulary's longest piece), so a
10 MB result costs what a short one does.

`TOOL_CHAT_TEMPLATE` is the template grpo_fast ships for ChatML models without one that renders tools
(SmolLM2-Instruct's renders none): Hermes-style `<tool_call>{json}</tool_call>` calls, results in a user
turn as `<tool_response>`; `RESPONSE_TEMPLATE` is transformers' parser for it, set on the tokenizer and
saved with it, so `tokenizer.parse_response` reads calls for grpo_fast and for stock TRL alike.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from .isolation import valid_text

TOOL_CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{{- messages[0]['content'] if messages[0]['role'] == 'system' else default_system }}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, write a JSON object with the function name and its arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{%- if loop.first and message['content'] %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{- f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

CALL_OPEN = "<tool_call>"  # a turn holding it but no parsed call is malformed (shipped template)
# a call whose arguments nest deeper is malformed: what a model writes is later copied and rendered by recursive
# code (deepcopy, the template's tojson), which a few hundred levels of brackets would take past Python's limit
MAX_ARGUMENT_NESTING = 32


def _dummy_calls(name: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "arguments": {}}}]


# (letters and digits only: a template that escapes contents, tojson included, leaves it as it is)
_SLOT = re.compile(r"GrpoFastUntrustedText(\d+)Q7x")


def slot(k: int) -> str:
    """The placeholder of the k-th untrusted text in messages given to `ChatTemplate.render`."""
    return f"GrpoFastUntrustedText{k}Q7x"


def _nesting(value) -> int:
    """How deep lists and dicts nest in `value` (iteratively: the model wrote it, to any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _valid(value):
    """A parsed call's name and arguments with lone surrogates replaced (valid_text), at any depth."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {_valid(k): _valid(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_valid(v) for v in value]
    return value


class ChatTemplate:
    """The template a multi-turn run renders with, checked: it renders the tools and is prefix-preserving.

    template: `chat_template_path`'s text, else the tokenizer's own if it renders tools, else (a ChatML
    tokenizer) TOOL_CHAT_TEMPLATE with RESPONSE_TEMPLATE set on the tokenizer."""

    def __init__(self, tokenizer, tools: Sequence, *, path: Optional[str] = None, kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.schemas = [t.schema for t in tools]
        self.kwargs = dict(kwargs or {})
        source = "the tokenizer's chat template"
        if path:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"chat_template_path: {path!r} is not a file (a Jinja chat template)")
            tokenizer.chat_template, source = p.read_text(), f"chat_template_path {path!r}"
        elif not self._renders_tools():
            if "<|im_start|>" not in (tokenizer.chat_template or ""):
                raise ValueError("chat_template_path: the tokenizer's chat template does not render tools and is not "
                                 "ChatML (for which grpo_fast ships one); give a template that renders `tools`")
            tokenizer.chat_template, source = TOOL_CHAT_TEMPLATE, "grpo_fast's ChatML tool template"
            tokenizer.response_template = RESPONSE_TEMPLATE  # (saved with the tokenizer: TRL reads it too)
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
            raise ValueError(f"chat_template_path: {source} has no response parser on the tokenizer (response_template) "
                             f"to read the model's calls with; set tokenizer.response_template")
        if not self._renders_tools():
            raise ValueError(f"chat_template_path: {source} does not render the tools "
                             f"{[s['function']['name'] for s in self.schemas]} (no tool name in its rendering)")
        if not self._prefix_preserving():
            raise ValueError(f"chat_template_path: {source} is not prefix-preserving (an assistant turn renders "
                             f"differently once tool results follow it), so the sampled tokens could not be kept "
                             f"verbatim; give a template whose earlier messages render the same whatever follows")
        self.source = source
        self.end_of_turn = tokenizer.eos_token_id
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.specials = sorted({*tokenizer.all_special_tokens, *(t.content for t in added.values() if t.special)},
                               key=len, reverse=True)
        # added tokens not marked special (Qwen's <tool_call>, </tool_response>, <think>) are matched as whole
        # tokens even with split_special_tokens: their strings in untrusted text are broken up instead. Only markup
        # (<...>): some tokenizers add plain runs of spaces as tokens, which are text, not template.
        self.markup = sorted({t.content for t in added.values() if not t.special and len(t.content) > 2
                              and t.content.startswith("<") and t.content.endswith(">")} - set(self.specials),
                             key=len, reverse=True)
        self.longest_piece = max((len(p) for p in tokenizer.get_vocab()), default=1)

    def char_bound(self, max_tokens: int) -> int:
        """Characters of a text that hold more than `max_tokens` tokens whenever the whole text has more: no token
        covers more characters than the vocabulary's longest piece (a byte-level piece: one character per byte)."""
        return (max_tokens + 1) * self.longest_piece

    def encode_untrusted(self, text: str) -> list[int]:
        """Ids of text a tool or environment returned: its special tokens' strings split as text, an added markup
        token's string broken up (`markup`)."""
        return self.tokenizer.encode(_broken_up(text, self.markup), add_special_tokens=False, split_special_tokens=True)

    def cut(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """(text cut to `max_tokens` tokens as `render` encodes it, whether it was cut): by characters first."""
        bound = self.char_bound(max_tokens)
        cut = len(text) > bound
        text = valid_text(text[:bound])
        ids = self.encode_untrusted(text)
        if len(ids) <= max_tokens:
            return text, cut
        return self.tokenizer.decode(ids[:max_tokens]), True

    def render(self, messages: list[dict], *, generation_prompt: bool, schemas: Optional[list] = None,
               untrusted: Sequence[str] = ()) -> list[int]:
        """Token ids of `messages` with the tools shown (`schemas`: a trajectory's own, an environment's; None: the
        run's). untrusted: texts a tool or an environment returned, the k-th standing in the messages as `slot(k)`;
        their special tokens' strings never become special tokens."""
        schemas = self.schemas if schemas is None else schemas
        untrusted = [valid_text(t) for t in untrusted]
        options = dict(tools=schemas or None, add_generation_prompt=generation_prompt, **self.kwargs)
        filled = _fill(messages, untrusted)
        if not any(s in text for text in untrusted for s in (*self.specials, *self.markup)):
            return list(self.tokenizer.apply_chat_template(filled, tokenize=True, return_dict=False, **options))
        # parts: template text, a slot's index, template text, ...
        parts = _SLOT.split(self.tokenizer.apply_chat_template(messages, tokenize=False, **options))
        if sorted(int(i) for i in parts[1::2]) != list(range(len(untrusted))) or \
                "".join(untrusted[int(p)] if k % 2 else p for k, p in enumerate(parts)) \
                != self.tokenizer.apply_chat_template(filled, tokenize=False, **options):
            # (a template that changes these texts as it renders them: their special strings broken up instead)
            return list(self.tokenizer.apply_chat_template(_fill(messages, [self._defused(t) for t in untrusted]),
                                                           tokenize=True, return_dict=False, **options))
        ids = []
        for k, part in enumerate(parts):
            if k % 2:
                ids += self.encode_untrusted(untrusted[int(part)])
            elif part:
                ids += self.tokenizer.encode(part, add_special_tokens=False)
        return ids

    def _defused(self, text: str) -> str:
        """text with each special or added markup token's string broken up (so that it no longer matches)."""
        return _broken_up(text, (*self.specials, *self.markup))

    def _renders_tools(self) -> bool:
        if not self.schemas or not self.tokenizer.chat_template:
            return bool(self.tokenizer.chat_template)
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=self.schemas,
                                                      tokenize=False, add_generation_prompt=True, **self.kwargs)
        except Exception:  # noqa: BLE001 (a template that cannot render tools)
            return False
        return all(s["function"]["name"] in text for s in self.schemas)

    def _prefix_preserving(self) -> bool:
        name = self.schemas[0]["function"]["name"] if self.schemas else "dummy"
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": _dummy_calls(name)}]
        tool = {"role": "tool", "name": name, "content": "dummy"}
        try:
            a = self.render(head, generation_prompt=False)
            b = self.render([*head, tool], generation_prompt=True)
            c = self.render([*head, tool, {"role": "assistant", "content": "done"}], generation_prompt=False)
        except Exception:  # noqa: BLE001
            return False
        return b[:len(a)] == a and c[:len(b)] == b

    def between_turns(self, tool_messages: list[dict]) -> list[int]:
        """The ids after a sampled turn's end-of-turn token up to the next turn's first sampled token: the
        template's tail after that token, the tool messages (their contents untrusted), the generation prompt
        (all masked out of the loss)."""
        head = [{"role": "user", "content": "dummy"},
                {"role": "assistant", "content": "", "tool_calls": _dummy_calls(tool_messages[0]["name"])}]
        a = self.render(head, generation_prompt=False)
        b = self.render([*head, *(dict(m, content=slot(k)) for k, m in enumerate(tool_messages))],
                        generation_prompt=True, untrusted=[m["content"] for m in tool_messages])
        ends = [i for i, t in enumerate(a) if t == self.end_of_turn]
        start = ends[-1] + 1 if ends else len(a)
        return b[start:]

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> tuple[str, list[dict], bool]:
        """(content, calls as {"name", "arguments"}, malformed) of one sampled turn: the parser's message text
        without the call markup, and its calls. Malformed: call markup that does not parse, a call without a
        name, or arguments nested deeper than MAX_ARGUMENT_NESTING (the content is then the turn's whole text)."""
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        prefix = self.tokenizer.decode(prefix_ids[-32:])  # (the parser looks back to the assistant header only)
        try:
            message = self.tokenizer.parse_response(turn_ids, prefix=prefix, tools=self.schemas or None)
        except Exception:  # noqa: BLE001 (the model's markup is not JSON: answered with an error result)
            return text, [], True
        calls = []
        for call in message.get("tool_calls") or []:
            f = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                return text, calls, True
            if _nesting(f.get("arguments", {})) > MAX_ARGUMENT_NESTING:
                return text, [], True
            calls.append({"name": valid_text(f["name"]), "arguments": _valid(f.get("arguments", {}))})
        if not calls and CALL_OPEN in self.tokenizer.decode(turn_ids):
            return text, [], True
        return (message.get("content") or "") if calls else text, calls, False


def _broken_up(text: str, strings: Sequence[str]) -> str:
    """text with a zero-width space after the first character of each of `strings` in it."""
    for s in strings:
        if s in text:
            text = text.replace(s, s[:1] + "\u200b" + s[1:])
    return text


def _fill(messages: list[dict], texts: Sequence[str]) -> list[dict]:
    """messages with each slot(k) in a string content replaced by texts[k]."""
    if not texts:
        return messages

    def fill(content):
        return _SLOT.sub(lambda m: texts[int(m.group(1))] if int(m.group(1)) < len(texts) else m.group(0), content) \
            if isinstance(content, str) else content

    return [dict(m, content=fill(m.get("content"))) if "content" in m else m for m in messages]

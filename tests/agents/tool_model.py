"""A tiny model made to call tools: the tiny Llama (tests/tiny_model.py) with a ChatML variant of its
byte-level tokenizer, fine-tuned for a few seconds, seeded, on scripted tool conversations.

The script (every conversation, 3 assistant turns): the user asks for a + b then times c; the
assistant calls `add`, reads the result (whose text says what comes next), calls `mul`, reads it,
and answers with the number. The model learns the markup and the turn order well enough that at
temperature 1 most trajectories call a tool and many run all 3 turns, which is what the tests need:
tools executed, trajectories of >= 3 turns. It does not learn arithmetic (no test asks it to).
"""

from __future__ import annotations

import os
import random

from tests.tiny_model import VOCAB_SIZE, tiny_llama_config

SPECIAL = ["<|im_start|>", "<|im_end|>"]  # ids 259, 260: eos is <|im_end|>, as SmolLM2's
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, not special (as Qwen's)

# A second prefix-preserving ChatML template that renders tools (compactly: their names only), beside the
# shipped one, which SmolLM2's tokenizer tests; the calls use the same markup, so RESPONSE_TEMPLATE parses them.
COMPACT_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for t in tools %}{{- ' ' + t['function']['name'] }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>' + message['content'] + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return f"{int(a) + int(b)} (now mul)"


def mul(a: int, b: int) -> str:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return f"{int(a) * int(b)} (done)"


TOOLS = [add, mul]
TOOL_NAMES = ["tests.agents.tool_model:add", "tests.agents.tool_model:mul"]  # (as --tools names them)


def right_answer(prompts, completions, completion_ids, answer, **columns):
    """1 when the last assistant message is the number the script asks for, plus a little per message (groups
    whose answers all agree still differ, so every step has a gradient)."""
    return [float(c[-1]["role"] == "assistant" and c[-1]["content"].strip() == a) + 0.05 * len(c) + 0.001 * len(ids)
            for c, a, ids in zip(completions, answer, completion_ids, strict=True)]


def build_chatml_tokenizer():
    """The tiny byte-level tokenizer with ChatML's specials (eos <|im_end|>) and the tool tags as added
    tokens, in the first filler ids; its chat template renders tools (COMPACT_TOOL_TEMPLATE) and
    grpo_fast's response parser is set on it (and saved with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_fast.generation.agents.chat import RESPONSE_TEMPLATE
    from tests.tiny_model import PAD

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    pieces = [PAD, "<s>", "</s>", *byte_chars, *SPECIAL, *TAGS]
    pieces += [f"<t{i}>" for i in range(len(pieces), VOCAB_SIZE)]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, "<s>", "</s>", *SPECIAL])
    tok.add_tokens(TAGS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token=PAD,
                                        chat_template=COMPACT_TOOL_TEMPLATE)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def scripted_conversation(rng: random.Random, muls: int = 1) -> list[dict]:
    """The script; muls > 1 (benchmarks/bench_agents.py's chains): mul is called again while its result says
    "(now mul)", on the last result and c."""
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
    call = lambda name, x, y: [{"type": "function", "function": {"name": name, "arguments": {"a": x, "b": y}}}]  # noqa: E731
    messages = [{"role": "user", "content": f"({a}+{b})*{c}?"},
                {"role": "assistant", "content": "", "tool_calls": call("add", a, b)},
                {"role": "tool", "name": "add", "content": add(a, b)}]
    value = a + b
    for k in range(muls):
        messages += [{"role": "assistant", "content": "", "tool_calls": call("mul", value, c)},
                     {"role": "tool", "name": "mul", "content": mul(value, c) if k == muls - 1 else f"{value * c} (now mul)"}]
        value *= c
    return messages + [{"role": "assistant", "content": str(value)}]


def tool_prompts(n: int, seed: int = 0) -> list[dict]:
    """Dataset rows (conversational prompts, the answer column) in the script's form."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        conv = scripted_conversation(rng)
        rows.append({"prompt": conv[:1], "answer": conv[-1]["content"]})
    return rows


def _assistant_mask(tokenizer, messages, schemas) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation and which of them the assistant wrote (its turns, end-of-turn included)."""
    ids, mask = [], []
    for k in range(1, len(messages) + 1):
        upto = tokenizer.apply_chat_template(messages[:k], tools=schemas, tokenize=True, return_dict=False)
        new = upto[len(ids):]
        if messages[k - 1]["role"] == "assistant":  # the header "<|im_start|>assistant\n" is not the model's
            header = len(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))
            mask += [False] * header + [True] * (len(new) - header - 1) + [False]  # (the "\n" after <|im_end|>)
        else:
            mask += [False] * len(new)
        ids = list(upto)
    return ids, mask


def build_tool_model(path: str | os.PathLike, *, seed: int = 0, steps: int = 60, conversations: int = 16,
                     max_muls: int = 1) -> str:
    """Write the tiny tool-calling model (fp32 safetensors + its tokenizer) to `path`; return it as str. 60 full-batch
    AdamW steps on 16 conversations: about 8 s on 2 cores; at temperature 1 it then runs the script's 3 turns in
    most trajectories, and now and then writes call markup that does not parse (which the tests want too).
    max_muls > 1: conversations of 1 to max_muls mul calls (uniform), for a model that calls mul while told to."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import get_json_schema

    path = os.fspath(path)
    tokenizer = build_chatml_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    schemas = [get_json_schema(f) for f in TOOLS]
    rng = random.Random(seed)
    examples = [_assistant_mask(tokenizer, scripted_conversation(rng, rng.randint(1, max_muls) if max_muls > 1 else 1),
                                schemas) for _ in range(conversations)]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    for i, (seq, mask) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, :len(seq)] = torch.where(torch.tensor(mask), torch.tensor(seq), torch.tensor(-100))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(eos_token_id=eos)).float()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

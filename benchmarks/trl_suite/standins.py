"""Local stand-ins for the hub models and datasets that TRL's tests/test_grpo_trainer.py loads.

Built once into a folder laid out as a Hugging Face hub cache (`models--trl-internal-testing--tiny-X/refs/main`
and `snapshots/<commit>/`), so with `HF_HUB_CACHE` pointing there and `HF_HUB_OFFLINE=1` every loader
(`AutoModelForCausalLM`, `AutoTokenizer`, `AutoConfig`, remote code) resolves the test file's hub ids without a
patch and without a network. Datasets are saved `DatasetDict`s, one per (dataset, config), that the pytest
plugin's `load_dataset` returns.

The models are random and tiny, of the architecture the hub id names (the sizes of TRL's own tiny models:
hidden 8, 4 heads, 2 KV heads, 2 layers, bf16 weights), on one stand-in tokenizer: a byte-level BPE whose 256
byte tokens sit at the ids the Qwen2.5 vocabulary gives them, with the multi-character tokens TRL's tool tests
hard-code (`TOOL_TEST_TOKENS`) at their Qwen2.5 ids, fillers elsewhere, and the Qwen2.5/Qwen3 added tokens at
their real ids (151,643 to 151,668). It encodes text byte by byte (no merges): any text round-trips, and the
ids the tests feed in decode to the text their comments give. Chat templates are TRL's own Qwen2.5 and Qwen3
ones (read from the installed TRL), so TRL recognises them and sets its tool-call parser.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ORG = "trl-internal-testing"
VERSION = "v3"  # bump when a stand-in changes: the cache folder is rebuilt
COMMIT = "0" * 40  # the one "revision" of every stand-in repository
VOCAB_SIZE = 151936  # Qwen's padded embedding size: covers every id the tests hard-code

# Qwen2.5's added tokens from 151,643 on, then Qwen3's four; `special` as Qwen marks them (tool tags are plain
# added tokens, so `skip_special_tokens` keeps them in the decoded text TRL parses tool calls from).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
FIRST_ADDED_ID = 151643
BOS_ID, EOS_ID, PAD_ID = 151643, 151645, 151643  # Qwen instruct: eos <|im_end|>, pad <|endoftext|>

# The multi-character tokens of the ids TRL's tool and environment tests hard-code, split so that each id
# sequence decodes to the text the test's comment gives (the split of a word over two ids is ours: only the
# concatenation is checked). Byte-level spelling: "Ġ" is a space, "Ċ" a newline.
TOOL_TEST_TOKENS = {
    4913: '{"', 606: "name", 788: '":', 330: 'Ġ"', 497: '",', 16370: "arguments", 5212: 'Ġ{"', 11248: "}}Ċ",
    64648: "multiply", 22785: "_tool", 7692: "async", 93054: "_multiply", 35744: "increment", 9520: "step",
    450: "de", 13477: "crement", 927: "sh", 411: "out", 1318: "text", 6023: "hi", 95642: '"}}Ċ', 2765: "Ġwon",
    944: "'t", 16252: "Ġincrement", 1513: "Ġdon", 1414: "Ġknow", 894: "Ġany", 5392: "Ġtool", 17453: "Done",
    14172: "tool", 6659: "call", 397: ">Ċ", 522: "</", 314: "Ġ{", 293: "Ġb",
}

# hub repository -> (model_type, class, config fields beyond COMMON); the sizes follow TRL's tiny models
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=32, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
MOE = dict(num_experts_per_tok=2)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "Qwen2ForCausalLM", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "Qwen2ForSequenceClassification",
                                                 dict(num_labels=1, hidden_size=16)),
    "tiny-Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification",
                                            dict(num_labels=1, hidden_size=16)),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4, head_dim=128)),
    "tiny-GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM", dict(MOE, num_local_experts=4)),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM",
                                dict(MOE, n_routed_experts=4, moe_intermediate_size=32, head_dim=2, attention_bias=True,
                                     use_qk_norm=True, routed_scaling_factor=2.5)),
    # Gemma 2 soft-caps its logits (final_logit_softcapping 30, the config's default) and ties its embeddings;
    # Cohere 2 scales them (logit_scale 0.0625, the config's default: TRL's tiny model sets 1.0, a scale of one
    # would not exercise the transform)
    "tiny-Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", {}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM", {}),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "NemotronHForCausalLM",
                                       dict(hidden_size=16, layers_block_type=["mamba", "attention", "moe"],
                                            mamba_num_heads=8, mamba_head_dim=4, n_groups=1, ssm_state_size=16,
                                            conv_kernel=4, expand=2, n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                            num_hidden_layers=None)),
    "tiny-LlamaForCausalLM-3.2": ("llama", "LlamaForCausalLM", dict(tie_word_embeddings=True)),  # as Llama 3.2 1B
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "LlamaForSequenceClassification", dict(num_labels=1)),
    "tiny-MistralForCausalLM-0.2": ("mistral", "MistralForCausalLM", {}),
    "tiny-RemoteForCausalLM": ("remote", "RemoteForCausalLM", {}),  # custom code: REMOTE_CODE below
}

# The custom-code model of test_trust_remote_code: a Llama under another model_type, loaded through auto_map
REMOTE_CODE = {
    "configuration_remote.py": (
        "from transformers import LlamaConfig\n\n\n"
        "class RemoteConfig(LlamaConfig):\n    model_type = \"remote\"\n"
    ),
    "modeling_remote.py": (
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    ),
}

# trl-internal-testing/zen: 17 train and 2 test prompts, each the start of a line of the Zen of Python (PEP 20) as
# in TRL's dataset; test_prepare_input_called_with_correct_data checks the first twelve train rows by value and
# counts steps from the number of rows
ZEN_PROMPTS = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one",
    "Although that way may not be", "Now is better", "Although never is often better", "If the implementation",
    "If the implementation is easy", "Namespaces are one",
]


def hub_folder(cache: Path, repo: str) -> Path:
    return cache / "hub" / f"models--{ORG}--{repo}"


def snapshot(cache: Path, repo: str) -> Path:
    return hub_folder(cache, repo) / "snapshots" / COMMIT


def dataset_folder(cache: Path, name: str, config: str) -> Path:
    return cache / "datasets" / name / config


def build_tokenizer():
    """The stand-in tokenizer (see the module docstring), a PreTrainedTokenizerFast without a chat template."""
    return _tokenizer(_trained_merges(_tokenizer([])))


def _tokenizer(merges: list[tuple[str, str]]):
    """The stand-in vocabulary (bytes, the tool tests' tokens, the tokens `merges` build, fillers) with `merges`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte order: the printable bytes first, then the rest (Qwen's ids 0..255)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    order = printable + [b for b in range(256) if b not in printable]
    byte_token = _bytes_to_unicode()
    vocab = {byte_token[b]: i for i, b in enumerate(order)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()), "the byte alphabet differs from tokenizers' one"
    for token_id, text in TOOL_TEST_TOKENS.items():
        vocab[text] = token_id
    free = (i for i in range(256, FIRST_ADDED_ID) if i not in TOOL_TEST_TOKENS)
    for left, right in merges:  # each merged token at the next free id (a tool test's token keeps its own)
        if left + right not in vocab:
            vocab[left + right] = next(free)
    for token_id in free:  # fillers: " w<id>" in byte-level spelling, each unique
        vocab[f"Ġw{token_id}"] = token_id
    assert len(vocab) == FIRST_ADDED_ID, "ids below the added tokens must be exactly covered"

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for text, special in ADDED_TOKENS:
        if special:
            tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(text, special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        model_max_length=32768)
    for index, (text, _) in enumerate(ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(text) == FIRST_ADDED_ID + index, text
    return tokenizer


def _sample_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def _trained_merges(byte_tokenizer, merges: int = 2000) -> list[tuple[str, str]]:
    """BPE merges learnt from the chat templates' renderings of the zen prompts, with and without a tool, so that
    prompts take about as many tokens as under Qwen's tokenizer (byte by byte, a tool prompt is ~4x longer, and
    stock TRL's CPU log-prob pass scores every position over the whole vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = []
    for template in {chat_template_for("tiny-Qwen2"), chat_template_for("tiny-Qwen3")}:
        byte_tokenizer.chat_template = template
        for prompt in ZEN_PROMPTS:
            call = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "_sample_tool", "arguments": {"a": 3, "b": 4}}}]}
            for messages, tools in (([{"role": "user", "content": prompt}], None),
                                    ([{"role": "user", "content": prompt}, call,
                                      {"role": "tool", "name": "_sample_tool", "content": "12"}], [_sample_tool])):
                texts.append(byte_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False))
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    model.train_from_iterator(texts, trainer)
    return [tuple(pair) if not isinstance(pair, str) else tuple(pair.split(" ", 1))
            for pair in json.loads(model.to_str())["model"]["merges"]]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def chat_template_for(repo: str) -> str:
    import trl.chat_template_utils as templates

    return templates.qwen3_chat_template if repo.startswith("tiny-Qwen3") else templates.qwen2_5_chat_template


def _init_tiny(model) -> None:
    """Random weights that keep a tiny bf16 model finite: Xavier on linear layers, N(0, 0.02) on embeddings
    (the rest keeps the model's own initialisation)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def build_model(repo: str, folder: Path, tokenizer) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig

    model_type, class_name, fields = MODELS[repo]
    fields = {**COMMON, **fields}
    fields = {k: v for k, v in fields.items() if v is not None}
    # the custom-code model is a Llama saved under the remote model_type (same weights' names): no import of its code
    config = AutoConfig.for_model("llama" if model_type == "remote" else model_type, **fields)
    model = getattr(transformers, "LlamaForCausalLM" if model_type == "remote" else class_name)(config)
    _init_tiny(model)
    model.to(torch.bfloat16).save_pretrained(folder)
    if model_type == "remote":
        for name, code in REMOTE_CODE.items():
            (folder / name).write_text(code)
        saved = json.loads((folder / "config.json").read_text())
        saved.update(model_type="remote", architectures=[class_name],
                     auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                               "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(folder)
    tokenizer.chat_template = chat_template_for(repo)
    tokenizer.save_pretrained(folder)


def build_datasets(cache: Path) -> None:
    from datasets import Dataset, DatasetDict

    def split(rows):
        return DatasetDict(train=Dataset.from_dict(rows(ZEN_PROMPTS[:17])), test=Dataset.from_dict(rows(ZEN_PROMPTS[17:])))

    split(lambda p: {"prompt": p}).save_to_disk(str(dataset_folder(cache, "zen", "standard_prompt_only")))
    conversational = lambda p: {"prompt": [[{"role": "user", "content": x}] for x in p]}  # noqa: E731
    split(conversational).save_to_disk(str(dataset_folder(cache, "zen", "conversational_prompt_only")))


def build(cache_root: Path) -> Path:
    """The stand-in cache (built if missing), `cache_root/VERSION`; returns it. Set HF_HUB_CACHE to its hub/."""
    cache = Path(cache_root) / VERSION
    done = cache / "complete"
    if done.exists():
        return cache
    shutil.rmtree(cache, ignore_errors=True)
    tokenizer = build_tokenizer()
    for repo in MODELS:
        folder = snapshot(cache, repo)
        folder.mkdir(parents=True)
        build_model(repo, folder, tokenizer)
        refs = hub_folder(cache, repo) / "refs"
        refs.mkdir()
        (refs / "main").write_text(COMMIT)
    build_datasets(cache)
    done.write_text("ok\n")
    return cache


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="folder to build the stand-ins in")
    print(build(parser.parse_args().cache))

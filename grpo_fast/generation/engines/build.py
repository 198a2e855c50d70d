"""The run's rollout engine, built once from its row (`engine_kind`): a kind that samples with the live policy gets
the policy; one that loads weights gets a folder (a model passed in is written to one first), then the whole
policy as it is now (`initial_sync`: resumed or cast weights, LoRA's route)."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Optional

from ...bounds import FRACTION_OPEN_LOW, INTEGER_AT_LEAST_1
from ...options import mirror, option, options_record
from . import ENGINE_CHOICES, engine_kind, make_engine


@options_record
@dataclass(frozen=True)
class EngineOptions:
    """The options the run's engine is built with: the fields declared here, and GRPOConfig's it reads (mirror)."""

    engine: str = option("auto", "Rollout engine. auto: vLLM when it is installed, else HF transformers generate (shares the policy's weights).", ENGINE_CHOICES)
    vllm_max_model_length: Optional[int] = option(None, "vLLM's context length. None: max_prompt_length + the longest sequence after the prompt (max_completion_length; more with the early_exit and multi_answer rollout modes).", bounds=INTEGER_AT_LEAST_1)
    vllm_gpu_memory_utilization: float = option(0.3, "Fraction of GPU memory vLLM may take (GPU only).", bounds=FRACTION_OPEN_LOW)
    vllm_enable_sleep_mode: bool = option(False, "Put vLLM to sleep (free its memory) during the training part of a step (GPU only).")
    seed: int = mirror(42)
    load_in_4bit: bool = mirror(False)
    routing_replay: bool = mirror(False)  # (models/routing.py declares both: the engine records its routing for them)
    record_routing: bool = mirror(False)
    lora_route: Optional[str] = None  # GRPOConfig.lora_route: how an engine that loads weights samples a LoRA adapter
    # the caller's: the run's sampling truncates, so an engine that loads weights returns the kept sets where it can
    # (vLLM's return_sampling_mask; the HF engine always does)
    return_sampling_mask: bool = False


def build_engine(options: EngineOptions, precision, model, tokenizer, model_path):
    """The rollout engine of options.engine ("auto": vLLM when installed); precision: `models.precision.Precision`
    (the engine's dtype)."""
    from ...models import lora
    from ...models.policy import context_limit

    kind = engine_kind(options.engine, loadable_from_disk=True)  # (a model passed in is written to disk below)
    records = {"record_routing": True} if options.routing_replay or options.record_routing else {}
    if not kind.loads_weights:
        return make_engine(kind.name, model=model, tokenizer=tokenizer, max_model_len=options.vllm_max_model_length,
                           **records)
    route = options.lora_route if lora.is_lora(model) else None
    folder = None
    if model_path is None:  # a model passed in: the engine loads from disk, so write it once
        folder = model_path = tempfile.mkdtemp(prefix="grpo_fast_engine_")
        if route:  # the base alone, under its HF names
            model.get_base_model().save_pretrained(model_path, safe_serialization=True, state_dict={
                name: t.contiguous() for name, t in lora.engine_weights(model, merged=False)})
        else:
            model.save_pretrained(model_path, safe_serialization=True)
        tokenizer.save_pretrained(model_path)
        _copy_processor_files(model, model_path)
    # max_prompt_length=None leaves the engine's context to the model's own limit
    max_model_len = options.vllm_max_model_length or context_limit(model.config) or 2048
    cuda = next(model.parameters()).is_cuda
    engine = make_engine(kind.name, model_path=model_path,
                         dtype=str(precision.engine_dtype(cuda)).replace("torch.", ""),
                         max_model_len=max_model_len, seed=options.seed,
                         gpu_memory_utilization=options.vllm_gpu_memory_utilization,
                         enable_sleep_mode=options.vllm_enable_sleep_mode,
                         **({"lora": lora.spec(model)} if route == "adapter" else {}),
                         # QLoRA: the engine quantises the same base to 4 bits as it loads (bitsandbytes NF4), so it
                         # samples what the trainer computes with (checked by the sync probe; GPU only, untested here)
                         **({"quantization": "bitsandbytes"} if options.load_in_4bit else {}), **records,
                         **({"return_sampling_mask": True} if options.return_sampling_mask else {}))
    initial_sync(engine, model, route)  # the policy may differ from the folder (resumed, or cast)
    if folder is not None:  # read once, at the engine's start: removed with the engine (or at exit)
        weakref.finalize(engine, shutil.rmtree, folder, True)
    return engine


# a VLM's image processor and processor settings: vLLM's own processor reads them from the folder it loads
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json")


def _copy_processor_files(model, folder: str) -> None:
    """A vision-language model written to a folder for the engine: its processor's files copied from the folder it was
    loaded from (so vLLM expands image placeholders as the trainer's processor did)."""
    import os

    source = getattr(model, "name_or_path", None)
    if getattr(model.config, "vision_config", None) is None or not source or not os.path.isdir(source):
        return
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(folder, name))


def initial_sync(engine, model, route: Optional[str]) -> None:
    """The whole policy into a new engine: every weight (with LoRA's merged route, the adapted layers
    merged); the adapter route loads the base from its folder and the adapter as its version 0."""
    from ...models import lora

    if route == "adapter":
        engine.update_adapter(0, lora.adapter_tensors(model))
    elif route == "merged":
        engine.update_weights(lora.engine_weights(model, merged=True))
    else:
        engine.update_weights(model)


def check_partial_rollouts(engine, max_staleness: int) -> None:
    """max_staleness >= 1 needs an engine that runs partial rollouts (its `runs_partial_rollouts`)."""
    if not engine.runs_partial_rollouts:
        raise ValueError(f"max_staleness={max_staleness} needs the vLLM engine (partial rollouts run in its "
                         f"request loop), got {type(engine).__name__}; install vllm or set max_staleness=0")

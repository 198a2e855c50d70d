"""The run's precisions: the policy weights' dtype, the decoder's autocast, the vLLM engine's dtype, resolved on
this machine ("auto" depends on it: bf16 where the CPU has bf16 matmul hardware, docs/design.md "Precision"),
whether the IS correction defaults on, and the run's first line that says what they resolved to."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..compat import cpu_has_bf16_matmul
from ..options import option, options_record

DTYPES = ("auto", "float32", "bfloat16", "float16")  # dtype's and vllm_dtype's choices


@options_record
@dataclass(frozen=True)
class Precision:
    """The precision options as asked (declared here: GRPOConfig takes them); the methods resolve them for a
    device."""

    dtype: str = option("auto", "Training dtype of the policy weights. auto: bfloat16 on CUDA, float32 on CPU (bf16=True forces bfloat16).", DTYPES)
    bf16: Optional[bool] = option(None, "TRL's switch: True trains in bfloat16, False in float32; None leaves it to `dtype`.")
    mixed_precision: str = option("auto", "bf16: run the policy's decoder under torch.autocast in bfloat16 (matmuls in bf16; weights, optimizer state, the lm_head and the fused loss stay in the training dtype), in training and in the old-policy and reference passes. no: the decoder in the training dtype. auto: bf16 on a CPU with bf16 matmul hardware (AMX or avx512_bf16) when the weights are float32, no elsewhere (CUDA trains bfloat16 weights by default; CPUs without that hardware would emulate bf16, about 100x slower than float32, and the trainer warns when bf16 is asked for there). (docs/design.md and benchmarks/results/precision_cpu.md have the measurements.)", ("auto", "no", "bf16"))
    vllm_dtype: str = option("auto", "dtype the vLLM engine samples in (trl vllm-serve's --dtype). auto: the training dtype, except on a CPU with bf16 matmul hardware (AMX or avx512_bf16), where a bfloat16 engine generates faster: bfloat16 there. A bf16 engine turns the IS correction on by default.", DTYPES)

    @property
    def use_bf16(self) -> Optional[bool]:
        """True/False when bf16 or dtype decides; None when the device decides (dtype='auto')."""
        if self.bf16 is not None:
            return self.bf16
        return None if self.dtype == "auto" else self.dtype == "bfloat16"

    def weights_dtype(self, cuda: Optional[bool] = None) -> torch.dtype:
        """The policy weights' dtype: dtype / bf16; auto: bfloat16 on CUDA, float32 on the CPU."""
        bf16 = self.use_bf16
        if bf16 is None:
            bf16 = torch.cuda.is_available() if cuda is None else cuda
        if self.dtype == "float16":
            return torch.float16
        return torch.bfloat16 if bf16 else torch.float32

    def amp_dtype(self, cuda: bool) -> Optional[torch.dtype]:
        """The autocast dtype of the decoder (mixed_precision), None for none. auto: bf16 on a CPU with bf16
        matmul hardware when the weights are float32."""
        mode = self.mixed_precision
        if mode == "auto":
            mode = "bf16" if _bf16_cpu(cuda) and self.weights_dtype(cuda) == torch.float32 else "no"
        return torch.bfloat16 if mode == "bf16" else None

    def engine_dtype(self, cuda: bool) -> torch.dtype:
        """The vLLM engine's dtype (vllm_dtype). auto: the training dtype, bf16 on a CPU with bf16 matmul
        hardware."""
        if self.vllm_dtype != "auto":
            return getattr(torch, self.vllm_dtype)
        return torch.bfloat16 if _bf16_cpu(cuda) else self.weights_dtype(cuda)


def _bf16_cpu(cuda: bool) -> bool:
    """Where the "auto" precisions pick bf16 over float32: a CPU whose matmuls run bf16 in hardware
    (decided from its features, not its vendor; benchmarks/results/precision_cpu.md)."""
    return not cuda and cpu_has_bf16_matmul()


def default_is_correction(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, max_staleness: int) -> bool:
    """vllm_importance_sampling_correction=None: on where the sampler's log-probs differ from the
    trainer's, i.e. either side computes below float32 (the engine's dtype; the trainer's weights or
    autocast), or tokens are stale (partial rollouts)."""
    return {engine_dtype, trainer_dtype} != {torch.float32} or max_staleness > 0


def trainer_dtype(packer, model) -> torch.dtype:
    """The dtype the trainer's log-probs are computed in: the decoder's autocast dtype, else the weights'."""
    return packer.amp_dtype or next(model.parameters()).dtype


def warn_emulated_bf16(precision: Precision, model, engine_reads_vllm_dtype: bool) -> None:
    """A warning, before any work, when bf16 was asked for on a CPU that would emulate it (vllm_dtype counts where
    the engine may read it: `engine_reads_vllm_dtype`)."""
    if next(model.parameters()).is_cuda or cpu_has_bf16_matmul():
        return
    asked = [what for what, on in (("mixed_precision='bf16'", precision.mixed_precision == "bf16"),
                                   ("bfloat16 weights", precision.weights_dtype() == torch.bfloat16),
                                   ("vllm_dtype='bfloat16'", precision.vllm_dtype == "bfloat16" and engine_reads_vllm_dtype))
             if on]
    if asked:
        warnings.warn(f"{' and '.join(asked)} on a CPU without bf16 matmul hardware (no avx512_bf16, no AMX): "
                      f"torch emulates bf16 there, about 100x slower than float32; use float32 on this machine",
                      stacklevel=3)


def precision_summary(model, engine, packer, is_policy, *, mode_picked: bool, lora_route: Optional[str],
                      lora_auto: bool) -> str:
    """One line: what the precision settings resolved to on this machine ("auto" depends on it). is_policy: the
    run's `train.logprobs.ISPolicy`; mode_picked: its IS mode was picked for the loss type (vespo's token-level
    mode); lora_route, lora_auto: how the engine samples a LoRA adapter, and whether lora_sync='auto' chose it."""
    from . import lora

    name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
    weights = next(model.parameters()).dtype
    engine_part = "shares the policy" if is_policy.shares_weights else name(engine.dtype)
    amp = f"{name(packer.amp_dtype)} autocast" if packer.amp_dtype else "no autocast"
    picked = " (vespo's token-level mode)" if mode_picked else ""
    is_mode = (f"on ({is_policy.mode}{picked}{', from the step' if is_policy.in_step else ''})"
               if is_policy.use_is else "off")
    line = f"precision: weights {name(weights)}, decoder {amp}, engine {engine_part}, IS correction {is_mode}"
    if lora.is_lora(model):  # what the adapter is and how the engine samples it (auto resolved)
        route = None if is_policy.shares_weights else lora_route
        line += "\n" + lora.summary(model, route) + (" (auto)" if route and lora_auto else "")
    return line

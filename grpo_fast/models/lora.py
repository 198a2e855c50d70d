"""LoRA adapters on the policy, through the `peft` library: built and checked once, then read by the
stages that care (the reference pass, the weight sync, checkpoints).

The adapter is never merged into the training weights. What the engine samples with comes from here:

- `engine_weights(model, merged=True)`: every weight under its HF checkpoint name, each targeted linear
  layer as `W_base + s * B @ A` computed in float32 from the untouched base (the `merged` sync route);
  `only_adapted=True` yields the targeted (and saved) modules alone: a partial weight update.
- `adapter_tensors(model)`: the trained A / B (and modules_to_save) in PEFT's file layout, which vLLM's
  LoRA loader reads (the `adapter` sync route).

The lm_head never carries an adapter: the fused loss reads its weight directly. `LoraOptions` declares the run's
LoRA options (GRPOConfig's use_peft and lora_* fields, TRL's ModelConfig names).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from ..bounds import INTEGER_AT_LEAST_1, Bounds
from ..options import option, options_record

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# grpo_fast's record of the base an adapter was trained on, beside PEFT's files: {"path": absolute and resolved,
# "sha256": models.weights_fingerprint of its weights}. PEFT's base_model_name_or_path was the --model text as given:
# a relative path, which an eval started in another folder resolved to a same-named folder there.
BASE_RECORD = "base_model.json"
POLICY, REFERENCE = "default", "ref"  # the trained adapter's name; a resumed-from adapter kept frozen as the reference
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (0.32)


@options_record
@dataclass(frozen=True)
class LoraOptions:
    """The adapter a run trains and how the engine samples it; the fields are named as GRPOConfig's, so the
    `fields_of_*` dicts below (a peft LoraConfig's, an adapter folder's) build one too."""

    use_peft: bool = option(False, "Train a LoRA adapter (the peft library) instead of every parameter: the optimizer holds the adapter alone, checkpoints hold the adapter and its optimizer state (megabytes), final/ holds adapter_config.json + adapter_model.safetensors (peft and vLLM load it). beta > 0 takes the reference from the same model with the adapter disabled (no second copy). The adapter is never merged into the training weights (lora_sync says how the engine samples it). A `model` that is a PEFT adapter folder trains that adapter on its base, its starting weights frozen as the reference.")
    lora_r: int = option(16, "use_peft: LoRA rank r.", bounds=INTEGER_AT_LEAST_1)
    lora_alpha: float = option(32, "use_peft: LoRA alpha; the update is scaled by lora_alpha / lora_r.", bounds=Bounds(low=0, low_open=True, finite=True))
    lora_dropout: float = option(0.0, "use_peft: dropout on the adapter's input, in the policy's training forward only (the engine, the reference and the no-grad passes run without it). TRL's default is 0.05; here 0.0, so that the trained forward is the one the engine samples and the IS ratio and sync probe compare.", bounds=Bounds(low=0, high=1, high_open=True))
    lora_target_modules: list = option(["all-linear"], "use_peft: the layers that get an adapter, by name (q_proj,v_proj,...) or all-linear (PEFT's keyword: every linear layer but the output layer). TRL leaves PEFT's per-model default, which for Llama is q_proj and v_proj only. The lm_head is refused (the fused loss reads its weight).")
    lora_modules_to_save: Optional[list] = option(None, "use_peft: modules trained in full beside the adapter (PEFT's modules_to_save, e.g. a norm). Refused for the lm_head, for models with tied embeddings and with lora_sync='adapter'.")
    lora_sync: str = option("auto", "use_peft: how the vLLM engine samples the live adapter. merged: the engine's targeted weights are rewritten each step as W_base + (alpha / r) B A, computed in float32 from a base kept untouched (a partial weight update; no LoRA cost in decode). adapter: vLLM's LoRA path (enable_lora), the new A / B delivered after each step as a new adapter version, the old one removed (syncs megabytes, decodes through LoRA kernels). auto: merged, or adapter for a 4-bit base (it cannot take merged weights); docs/design.md has the measurement. The run's first lines say which. The HF engine samples with the policy itself (nothing to sync).", ("auto", "merged", "adapter"))
    lora_base_model: Optional[str] = option(None, "use_peft, with `model` a PEFT adapter folder: the base model's folder, when the adapter's base_model_name_or_path is not a local folder.")
    load_in_4bit: bool = option(False, "use_peft: load the base in 4 bits (QLoRA, bitsandbytes on a CUDA GPU); refused where either is missing. The engine then samples through the adapter route or is the HF engine.")

def is_adapter_folder(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def adapter_base(path: str, lora_base_model: Optional[str]) -> str:
    """The base model of the PEFT adapter folder `path`: lora_base_model when given, else the adapter's
    `base_model_name_or_path` when it is a local folder (or names the default model), else refused.
    An adapter grpo_fast wrote records its base's weights (`BASE_RECORD`): a base whose weights differ
    is refused in one line, before anything loads."""
    from .loading import DEFAULT_MODEL

    if lora_base_model is not None:
        base = lora_base_model
    else:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            named = json.load(f).get("base_model_name_or_path")
        if named and os.path.isdir(named):
            base = named
        elif named and named.rstrip("/").rsplit("/", 1)[-1] == DEFAULT_MODEL.rsplit("/", 1)[-1]:
            base = "default"  # the default model's own name (its hub id or a path to it elsewhere): its installed copy
        else:
            raise ValueError(f"model={path!r} is a PEFT adapter whose base_model_name_or_path ({named!r}) is not a local "
                             f"folder (nothing is downloaded); pass the base model's folder with --lora_base_model")
    check_base(path, base, named=lora_base_model is not None)
    return base


def base_record(path: str) -> Optional[dict]:
    """The adapter folder's BASE_RECORD; None for an adapter without one (PEFT's, TRL's, an earlier version's)."""
    try:
        with open(os.path.join(path, BASE_RECORD)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{os.path.join(path, BASE_RECORD)} is unreadable ({err}): it records the base model the "
                         f"adapter was trained on; restore it, or delete it to skip the check") from None
    return record if isinstance(record, dict) and isinstance(record.get("sha256"), str) else None


def check_base(path: str, base: str, named: bool = False) -> None:
    """Refuse `base` for the adapter folder `path` when its weights are not those the adapter was trained on;
    named (the user gave it with --lora_base_model): say so once instead, since the same weights saved otherwise
    (other shards, a conversion) have other bytes, and the user has already chosen."""
    from .loading import DEFAULT_MODEL, default_model_path, weights_fingerprint

    record = base_record(path)
    if record is None:
        return
    folder = default_model_path() if base in ("default", DEFAULT_MODEL) else base
    if not os.path.isdir(folder):
        return  # (not a model folder: loading it names what is wrong)
    found = weights_fingerprint(folder)
    if found != record["sha256"] and named:
        warnings.warn(f"lora_base_model={base!r}: its weights' files (sha256 {found[:12]}) are not those the adapter "
                      f"{path!r} was trained on ({record.get('path')!r}, sha256 {record['sha256'][:12]}); using it as "
                      f"named (the same weights saved otherwise differ in bytes too)", stacklevel=2)
    elif found != record["sha256"]:
        raise ValueError(f"model={path!r} is a LoRA adapter trained on {record.get('path')!r} (weights sha256 "
                         f"{record['sha256'][:12]}), but its base {os.path.realpath(folder)!r} holds other weights "
                         f"(sha256 {found[:12]}): pass the model it was trained on (--model; --lora_base_model when --model is the "
                         f"adapter, which uses a base it names whatever its weights)")


def vllm_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM allows that holds rank r."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"GRPOConfig.lora_r={r} is invalid for lora_sync='adapter': vLLM's LoRA ranks go up to {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class LoraSpec:
    """What an engine needs to run the adapter route: the rank it must hold and PEFT's config (as in
    adapter_config.json)."""

    rank: int
    peft_config: dict


# ---- building ------------------------------------------------------------------------------------


def _linear_names(lm: nn.Module) -> list[str]:
    return [name for name, m in lm.named_modules() if isinstance(m, nn.Linear)]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def is_regex(targets: list) -> bool:
    """PEFT's two forms of target_modules: a string is a regular expression full-matched against module names
    (all-linear aside), a list holds names matched as suffixes. GRPOConfig keeps a list: one entry that is not a
    plain name is the string form."""
    return len(targets) == 1 and targets[0] != "all-linear" and not targets[0].isidentifier()


def _head_name(lm: nn.Module) -> Optional[str]:
    head = lm.get_output_embeddings()
    return next((name for name, m in lm.named_modules() if m is head), None)


def check_targets(lm: nn.Module, options: LoraOptions) -> None:
    """Before wrapping: every lora_target_modules entry names a linear layer of the model (listing those
    there are), neither list reaches the lm_head, and no modules_to_save with tied embeddings."""
    targets = list(options.lora_target_modules or [])
    head = _head_name(lm)
    linear = [n for n in _linear_names(lm) if n != head]
    kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if "all-linear" in targets and len(targets) > 1:
        raise ValueError(f"GRPOConfig.lora_target_modules={targets!r}: 'all-linear' stands alone (every linear layer "
                         f"but the lm_head) or is replaced by names of {kinds}")
    for t in targets:
        if t == "all-linear":
            continue
        hits = (lambda n: re.fullmatch(t, n) is not None) if is_regex(targets) else (lambda n: _matches(n, t))  # noqa: B023
        if head is not None and hits(head):
            raise ValueError(f"GRPOConfig.lora_target_modules={targets!r} reaches the lm_head ({head!r}), which never "
                             f"carries an adapter (the fused loss reads its weight; lora_modules_to_save may not name it "
                             f"either); target the decoder's layers: {kinds}")
        if not any(hits(n) for n in linear):
            raise ValueError(f"GRPOConfig.lora_target_modules={targets!r}: {t!r} names no linear layer of the model; "
                             f"its linear layers are {kinds} (or 'all-linear')")
    saved = list(options.lora_modules_to_save or [])
    modules = [n for n, _ in lm.named_modules()]
    for s in saved:
        if head is not None and _matches(head, s):
            raise ValueError(f"GRPOConfig.lora_modules_to_save={saved!r} reaches the lm_head (through {s!r}), which the "
                             f"fused loss reads directly; lora_target_modules may not name it either")
        if not any(_matches(n, s) for n in modules):
            raise ValueError(f"GRPOConfig.lora_modules_to_save={saved!r}: {s!r} names no module of the model")
    if saved and getattr(lm.config, "tie_word_embeddings", False):
        raise ValueError(f"GRPOConfig.lora_modules_to_save={saved!r} is refused for a model with tied embeddings (a "
                         f"trained copy would untie the lm_head from the embedding); set it to None")


def lora_config(options: LoraOptions):
    """peft's LoraConfig of the options' adapter."""
    from peft import LoraConfig

    targets = list(options.lora_target_modules or [])
    return LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                      target_modules=targets[0] if targets == ["all-linear"] or is_regex(targets) else targets,
                      modules_to_save=list(options.lora_modules_to_save) if options.lora_modules_to_save else None,
                      bias="none", task_type="CAUSAL_LM")


def _fields(peft_config) -> dict:
    """GRPOConfig's lora_* fields of a peft LoraConfig."""
    targets = peft_config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])
    saved = peft_config.modules_to_save
    return dict(lora_r=int(peft_config.r), lora_alpha=float(peft_config.lora_alpha),
                lora_dropout=float(peft_config.lora_dropout), lora_target_modules=targets,
                lora_modules_to_save=sorted(saved) if saved else None)


def fields_of_peft_config(peft_config) -> dict:
    """The GRPOConfig fields of a run given a `peft_config=` object: use_peft and the lora_* fields it sets, so the
    saved config (and a resume's check) describes the adapter."""
    return dict(use_peft=True, **_fields(peft_config))


def folder_config(path: str):
    """The LoraConfig of the adapter folder `path`."""
    from peft import LoraConfig

    return LoraConfig.from_pretrained(path)


def fields_of_folder(path: str, lora_dropout: float) -> dict:
    """The GRPOConfig fields of a run that trains the adapter folder `path`: its shape (r, alpha, targets, modules
    to save) from the folder, lora_dropout the run's own (dropout is how it is trained, not part of the adapter:
    a TRL adapter's 0.05 would make the trained forward differ from the sampled one)."""
    return dict(use_peft=True, **{**_fields(folder_config(path)), "lora_dropout": lora_dropout})


def fields_of_model(model) -> dict:
    """The GRPOConfig fields of a run given a PEFT model: its adapter (named POLICY, PEFT's default name) is
    trained."""
    if POLICY not in model.peft_config:
        raise ValueError(f"model=: a PEFT model whose adapters are {list(model.peft_config)}; grpo_fast trains the one "
                         f"named {POLICY!r} (PEFT's default name)")
    _check_plain(model.peft_config[POLICY], "model= (a PEFT model)")
    return fields_of_peft_config(model.peft_config[POLICY])


def _check_plain(peft_config, what: str) -> None:
    if getattr(peft_config, "use_dora", False) or getattr(peft_config, "bias", "none") != "none" \
            or getattr(peft_config, "lora_bias", False):
        raise ValueError(f"{what}: use_dora and LoRA biases are not supported (the engine's merged weights and vLLM's "
                         f"LoRA path compute plain LoRA: W + s B A); use plain LoRA")


def apply_lora(lm: nn.Module, options: Optional[LoraOptions], adapter_path: Optional[str] = None,
               peft_config=None) -> nn.Module:
    """The PEFT model around `lm`: a fresh adapter (peft_config, else one from the options' lora_* fields),
    or (adapter_path) that adapter trained on, with a frozen copy of it as the reference adapter
    (`REFERENCE`). Base weights frozen."""
    from peft import PeftModel, get_peft_model

    if adapter_path is None:
        if peft_config is not None:
            _check_plain(peft_config, "peft_config")
        check_targets(lm, options if peft_config is None else LoraOptions(**_fields(peft_config)))
        return get_peft_model(lm, peft_config if peft_config is not None else lora_config(options))
    folder = folder_config(adapter_path)
    _check_plain(folder, f"model={adapter_path!r} (its {ADAPTER_CONFIG})")
    check_targets(lm, LoraOptions(**_fields(folder)))
    if folder.modules_to_save:  # (the reference adapter would switch its LoRA layers, not these trained copies)
        raise ValueError(f"model={adapter_path!r}: an adapter with modules_to_save ({folder.modules_to_save}) cannot be "
                         f"trained on: its starting copy of them could not serve as the reference; start a new adapter")
    folder.lora_dropout = options.lora_dropout  # the run's (fields_of_folder)
    model = PeftModel.from_pretrained(lm, adapter_path, adapter_name=POLICY, is_trainable=True, config=folder)
    model.load_adapter(adapter_path, adapter_name=REFERENCE, is_trainable=False)
    model.base_model.set_adapter(POLICY)  # (loading may switch the active adapter) the trained one, trainable
    return model


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def has_reference_adapter(model) -> bool:
    return is_lora(model) and REFERENCE in model.peft_config


@contextlib.contextmanager
def reference_scope(model):
    """The policy model computing as the reference: its starting adapter where the run began from one,
    else the base with the adapter disabled. Sets the layers' active adapter directly (PEFT's set_adapter
    would also flip which adapter is trainable)."""
    if not has_reference_adapter(model):
        with model.disable_adapter():
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [REFERENCE]
    try:
        yield
    finally:
        for m, active in zip(layers, before, strict=True):
            m._active_adapter = active


# ---- what the engine gets ------------------------------------------------------------------------


def _lora_layers(lm: nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in lm.named_modules() if isinstance(m, LoraLayer)]


def merged_weight(layer, base: torch.Tensor, adapter: str = POLICY) -> torch.Tensor:
    """W_base + s * B @ A of one LoRA linear layer, in float32, as one addmm: the product is added to the
    base as it is written, one pass over a [out, in] tensor instead of three (a separate B @ A, its
    scaling and the sum; those passes were most of a merged sync's time on the CPU)."""
    a = layer.lora_A[adapter].weight.detach().float()
    b = layer.lora_B[adapter].weight.detach().float()
    base = base.detach().float()
    if getattr(layer, "fan_in_fan_out", False):  # (GPT-2's Conv1D stores W transposed: W^T + s A^T B^T)
        return torch.addmm(base, a.T, b.T, alpha=layer.scaling[adapter])
    return torch.addmm(base, b, a, alpha=layer.scaling[adapter])


def engine_weights(model, *, merged: bool, only_adapted: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, tensor) of the policy as an engine holds it. merged: targeted layers as
    W_base + s * B @ A (float32 from the untouched base), else the base. only_adapted: the targeted
    layers and the modules_to_save alone (a partial update)."""
    from peft.tuners.lora import LoraLayer

    lm = model.get_base_model()
    adapted = {name: m for name, m in _lora_layers(lm)}
    for name, param in lm.named_parameters():
        if ".lora_" in name or ".original_module." in name or f".modules_to_save.{REFERENCE}." in name:
            continue
        saved = f".modules_to_save.{POLICY}." in name
        hf_name = name.replace(f".modules_to_save.{POLICY}.", ".").replace(".base_layer.", ".")
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        layer = adapted.get(owner)
        if only_adapted and layer is None and not saved:
            continue
        tensor = param.detach()
        if merged and isinstance(layer, LoraLayer) and hf_name.endswith(".weight") and POLICY in layer.lora_A:
            tensor = merged_weight(layer, tensor)
        yield hf_name, tensor


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The trained adapter in PEFT's saved layout (`base_model.model.<module>.lora_A.weight`, ...)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=POLICY).items()}


def spec(model) -> LoraSpec:
    """The adapter route's `LoraSpec` of a PEFT model."""
    cfg = model.peft_config[POLICY]
    return LoraSpec(rank=vllm_rank(cfg.r), peft_config=cfg.to_dict())


def summary(model, route: Optional[str]) -> str:
    """One line for the run's first lines: the adapter, its size, how the engine samples it."""
    cfg = model.peft_config[POLICY]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    targets = cfg.target_modules  # (PEFT resolves all-linear to full names: shown by kind)
    targets = targets if isinstance(targets, str) else ",".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    ref = ", reference: the starting adapter" if has_reference_adapter(model) else ""
    sync = f", engine sync: {route}" if route else ""
    return (f"lora: r={cfg.r} alpha={cfg.lora_alpha} on {targets}: {trainable / 1e6:.2f}M trainable of "
            f"{total / 1e6:.1f}M parameters{ref}{sync}")


# ---- saving --------------------------------------------------------------------------------------


def save_adapter(model, folder: str, tokenizer=None) -> None:
    """adapter_config.json + adapter_model.safetensors (the trained adapter; loadable by peft and vLLM), with
    the base recorded by its absolute path (in adapter_config.json too) and its weights' fingerprint
    (BASE_RECORD) where the base is a local folder."""
    from .loading import weights_fingerprint

    base = _base_folder(model)
    if base is not None:  # (absolute: an adapter read from another working folder still finds its own base)
        model.peft_config[POLICY].base_model_name_or_path = base
    model.save_pretrained(folder, selected_adapters=[POLICY], safe_serialization=True)
    if base is not None:
        with open(os.path.join(folder, BASE_RECORD), "w") as f:
            json.dump({"path": base, "sha256": weights_fingerprint(base)}, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _base_folder(model) -> Optional[str]:
    """The folder the policy's base was loaded from, absolute and resolved (relative paths are the working
    folder's, the same as when it loaded); None for a model that did not come from a local folder."""
    name = getattr(model.get_base_model(), "name_or_path", None) or model.peft_config[POLICY].base_model_name_or_path
    return os.path.realpath(name) if name and os.path.isdir(name) else None


def save_merged(model, folder: str, tokenizer=None) -> None:
    """The base with the adapter merged (float32 arithmetic, stored in the base's dtype) as a plain HF folder;
    the live model is not touched."""
    lm = model.get_base_model()
    base_dtype = next(p for n, p in lm.named_parameters() if ".lora_" not in n).dtype
    state = {name: t.to(base_dtype).contiguous() for name, t in engine_weights(model, merged=True)}
    lm.save_pretrained(folder, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)

"""Checkpoints: an HF-format model + tokenizer, plus optimizer, scheduler, RNG and trainer state.

Written atomically: everything goes to a hidden temporary folder next to the target, which is
renamed into place only when complete, so a crash never leaves a half-written `checkpoint-N`.

    <output_dir>/checkpoint-<step>/
        model.safetensors, config.json, tokenizer files     (loadable by transformers and vLLM)
        trainer_state.pt   {"state": TrainState as dict, "optimizer", "scheduler", "rng", "config"}
"""

from __future__ import annotations

import os
import random
import re
import shutil

import torch

STATE_FILE = "trainer_state.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str, step: int, *, model, tokenizer, optimizer, scheduler, state: dict,
                    config: dict, total_limit: int | None = None) -> str:
    """Write `<output_dir>/checkpoint-<step>` atomically; prune to `total_limit` checkpoints."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save({"state": state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng_state(), "config": config}, os.path.join(tmp, STATE_FILE))
    if os.path.exists(final):  # a rerun of the same step: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    if total_limit is not None:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoint folders in `output_dir`, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _NAME.match(name))
             and os.path.exists(os.path.join(output_dir, name, STATE_FILE))]
    return [os.path.join(output_dir, name) for _, name in sorted(found)]


def resolve_checkpoint(spec: str, output_dir: str) -> str:
    """'latest' -> the newest checkpoint in output_dir; a folder -> itself. Errors say what was looked at."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint='latest': no checkpoint-* folder with {STATE_FILE} in {output_dir!r}")
        return found[-1]
    if not os.path.exists(os.path.join(spec, STATE_FILE)):
        raise FileNotFoundError(f"resume_from_checkpoint={spec!r}: not a grpo_fast checkpoint (no {STATE_FILE} there)")
    return spec


def load_model_weights(model, path: str) -> None:
    """Copy the safetensors weights of checkpoint `path` into `model` in place (tied weights allowed)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(os.path.join(path, f)))
    # copy into the live tensors (named_parameters lists a tied lm_head once, under the embedding)
    params = dict(model.named_parameters())
    own = {**params, **dict(model.named_buffers())}
    missing = [name for name in params if name not in weights]
    unexpected = [name for name in weights if name not in own and not name.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            if name in own:
                own[name].copy_(tensor)


def load_trainer_state(path: str) -> dict:
    # weights_only=False: the file holds Python RNG state and plain dicts written by save_checkpoint
    return torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)

"""Checkpoints: an HF-format model + tokenizer, plus optimizer, scheduler, RNG and trainer state.

Written atomically: everything goes to a hidden temporary folder next to the target, fsynced, and
renamed into place only when complete, so a crash never leaves a half-written `checkpoint-N` or
`final/`. The same holds for the trained model in `final/`.

    <output_dir>/checkpoint-<step>/
        model.safetensors, config.json, tokenizer files     (loadable by transformers and vLLM)
        trainer_state.pt   {"state": TrainState as dict, "optimizer", "scheduler", "rng", "config"}
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil

import torch

STATE_FILE = "trainer_state.pt"
TEMP_PREFIX = ".tmp-"
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
    def write(tmp: str) -> None:
        save_model(model, tokenizer, tmp)
        torch.save({"state": state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng_state(), "config": config}, os.path.join(tmp, STATE_FILE))

    # model + AdamW's two moments (float32 each) + RNG and small state
    needed = _tensor_bytes(model.parameters()) * 3
    final = write_atomically(os.path.join(output_dir, f"checkpoint-{step}"), write, needed_bytes=needed)
    if total_limit is not None:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_model(model, tokenizer, folder: str) -> None:
    """An HF folder (safetensors + config + tokenizer) that transformers and vLLM load."""
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def write_atomically(target: str, write, *, needed_bytes: int = 0) -> str:
    """Run `write(tmp_folder)`, fsync what it wrote, then rename the folder to `target`.

    A crash, a kill or a full disk at any moment leaves either the old `target` or the new one,
    never a torn one; the hidden temporary folder of a failed write is removed here, and those of a
    killed process by `remove_stale_temp_folders` at the next start. A full disk is reported as
    "no space left on <folder>" with the size the write needs (`needed_bytes`, an estimate).
    """
    parent, name = os.path.split(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{TEMP_PREFIX}{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write(tmp)
        _fsync_tree(tmp)
        if os.path.exists(target):  # a rerun of the same step, or final/ of a resumed run: replace it
            old = f"{tmp}.old"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err, parent, needed_bytes):
            free = shutil.disk_usage(parent).free
            raise OSError(errno.ENOSPC, f"no space left on {parent}: writing {name} needs about "
                          f"{needed_bytes / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free "
                          f"(earlier checkpoints are intact; free space, then resume)") from None
        raise
    return target


def remove_stale_temp_folders(output_dir: str) -> list[str]:
    """Delete the temporary folders that killed or failed saves left in `output_dir` (call it while
    holding the folder's lock: no other process is writing one)."""
    if not os.path.isdir(output_dir):
        return []
    stale = [os.path.join(output_dir, n) for n in os.listdir(output_dir) if n.startswith(TEMP_PREFIX)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _disk_full(err: BaseException, folder: str, needed_bytes: int) -> bool:
    """An ENOSPC/EDQUOT anywhere in the chain, or a write error while less than the size needed is
    free (torch.save reports a full disk as a RuntimeError of its zip writer: "unexpected pos")."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, (OSError, RuntimeError)) and shutil.disk_usage(folder).free < needed_bytes:
            return True
        err = err.__cause__ or err.__context__
    return False


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

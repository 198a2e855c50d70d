"""Checkpoints: model and optimizer in torch.distributed.checkpoint's format, plus an HF-format model,
scheduler, RNG and trainer state. One format for every world size, one process included.

Written atomically: everything goes to a hidden temporary folder next to the target, fsynced, and
renamed into place only when complete (by rank 0, once every rank has written its shards), so a
crash never leaves a half-written `checkpoint-N` or `final/`.

    <output_dir>/checkpoint-<step>/
        distributed/          model + AdamW state, torch.distributed.checkpoint: each rank writes its
                              shards (FSDP2) or rank 0 the replicated tensors (DDP, one process); any
                              number of ranks loads it, none at all included (no process group)
        model.safetensors, config.json, tokenizer files     (rank 0; loadable by transformers and vLLM)
        trainer_state.pt   {"state": TrainState as dict, "scheduler", "rng" (rank 0's), "rng_by_rank",
                            "config", "world_size"}

Checkpoints of earlier versions (the optimizer inside trainer_state.pt, no distributed/) still load.
Many ranks write into one folder: output_dir must be on storage that every node sees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import warnings

import torch

from .errors import chain

STATE_FILE = "trainer_state.pt"
DCP_FOLDER = "distributed"
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
                    config: dict, total_limit: int | None = None, parallel=None) -> str:
    """Write `<output_dir>/checkpoint-<step>` atomically; prune to `total_limit` checkpoints.
    parallel (distributed.py, None for one process): every rank calls this."""
    from .distributed import ONE_PROCESS, Parallel, gather_objects

    parallel = parallel or Parallel(model, ONE_PROCESS)
    world = parallel.world

    def write(tmp: str) -> None:
        save_sharded(model, optimizer, os.path.join(tmp, DCP_FOLDER))
        rngs = gather_objects(rng_state(), world)
        _save_whole_model(model, tokenizer, tmp, parallel)
        if world.main:
            torch.save({"state": state, "scheduler": scheduler.state_dict(), "rng": rngs[0], "rng_by_rank": rngs,
                        "config": config, "world_size": world.size}, os.path.join(tmp, STATE_FILE))

    # the HF model + the sharded model + AdamW's two moments (float32 each) + RNG and small state (LoRA: the adapter's)
    needed = _tensor_bytes(_saved_parameters(model)) * 4
    final = write_atomically(os.path.join(output_dir, f"checkpoint-{step}"), write, needed_bytes=needed, world=world)
    if total_limit is not None and world.main:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_final_model(target: str, model, tokenizer, parallel, merged: bool = False) -> str:
    """The trained model alone, as an HF folder at `target`, atomically (every rank calls this). A LoRA
    policy: its adapter (adapter_config.json + adapter_model.safetensors), and with `merged` also
    `merged/`, the base with the adapter merged."""
    from .models import lora

    def write(tmp: str) -> None:
        _save_whole_model(model, tokenizer, tmp, parallel)
        if merged and lora.is_lora(model) and parallel.world.main:
            lora.save_merged(model, os.path.join(tmp, "merged"), tokenizer)

    needed = _tensor_bytes(model.parameters()) if merged or not lora.is_lora(model) else _tensor_bytes(_saved_parameters(model))
    return write_atomically(target, write, needed_bytes=needed, world=parallel.world)


def _save_whole_model(model, tokenizer, folder: str, parallel) -> None:
    """Rank 0 writes the whole model as an HF folder (FSDP2: gathered to it first, a collective); a LoRA
    policy writes its adapter (megabytes: the base is the model it started from)."""
    from .models import lora

    if lora.is_lora(model):
        if parallel.world.main:
            lora.save_adapter(model, folder, tokenizer)
        return
    whole = parallel.full_state_dict()
    if parallel.world.main:
        save_model(model, tokenizer, folder, whole)


def _saved_parameters(model) -> list:
    """The parameters a checkpoint holds: the trained ones (all, or a LoRA adapter's)."""
    return [p for p in model.parameters() if p.requires_grad]


def _model_and_optimizer(model, optimizer) -> dict:
    """{"model", "optimizer"} state dicts keyed by parameter names, sharded as the live model is
    (torch's get_state_dict: DTensors under FSDP2, plain tensors otherwise). Frozen parameters are left
    out when there are any (a LoRA adapter's base: the model it started from, not trained)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    frozen = any(not p.requires_grad for p in model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=frozen))
    return {"model": model_sd, "optimizer": optim_sd}


@contextlib.contextmanager
def _no_process_group_notice():
    with warnings.catch_warnings():  # one process: "assuming the intent is to save/load in a single process"
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def save_sharded(model, optimizer, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    with _no_process_group_notice():
        dcp.save(_model_and_optimizer(model, optimizer), checkpoint_id=folder)


def load_sharded(model, optimizer, folder: str) -> None:
    """Load a `save_sharded` folder into the live model and optimizer, resharded to this world."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _model_and_optimizer(model, optimizer)  # (initialises AdamW's state, so it has a place to load into)
    with _no_process_group_notice():
        dcp.load(state, checkpoint_id=folder)
    frozen = any(not p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=frozen, strict=not frozen))


def load_model_and_optimizer(path: str, saved: dict, model, optimizer) -> None:
    """Restore model and optimizer from checkpoint `path` (saved by any number of ranks; `saved`:
    its `load_trainer_state`), resharded to this world."""
    if os.path.isdir(os.path.join(path, DCP_FOLDER)):
        load_sharded(model, optimizer, os.path.join(path, DCP_FOLDER))
    else:  # an earlier version's checkpoint: the HF weights and the optimizer's own state dict
        load_model_weights(model, path)
        optimizer.load_state_dict(saved["optimizer"])


def rank_rng_state(saved: dict, rank: int) -> dict:
    """This rank's RNG state where the saving run had this rank, else rank 0's."""
    by_rank = saved.get("rng_by_rank") or [saved["rng"]]
    return by_rank[rank] if rank < len(by_rank) else by_rank[0]


def save_model(model, tokenizer, folder: str, state_dict: dict | None = None) -> None:
    """An HF folder (safetensors + config + tokenizer) that transformers and vLLM load; state_dict:
    the weights to write instead of the live module's (FSDP2 holds shards)."""
    model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def write_atomically(target: str, write, *, needed_bytes: int = 0, world=None) -> str:
    """Run `write(tmp_folder)`, fsync what it wrote, then rename the folder to `target`.

    A crash, a kill or a full disk at any moment leaves either the old `target` or the new one,
    never a torn one; the hidden temporary folder of a failed write is removed here, and those of a
    killed process by `remove_stale_temp_folders` at the next start. A full disk is reported as
    "no space left on <folder>" with the size the write needs (`needed_bytes`, an estimate).
    world (many ranks): every rank calls this and writes its part into the same temporary folder;
    rank 0 makes and renames it, and a failure on any rank fails the write on all of them.
    """
    from .distributed import ONE_PROCESS, any_rank, barrier, gather_objects

    world = world or ONE_PROCESS
    parent, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(parent, f"{TEMP_PREFIX}{name}-{gather_objects(os.getpid(), world)[0]}")  # rank 0's pid
    error = None
    try:
        if world.main:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier(world)
        write(tmp)
    except BaseException as err:
        error = err
    failed = any_rank(error is not None, world)
    if not failed:  # once every rank has written: a rank's walk never meets another's file mid-rename
        try:
            _fsync_tree(tmp)
        except BaseException as err:
            error = err
        failed = any_rank(error is not None, world)
    try:
        if failed:
            raise error or RuntimeError(f"writing {name}: another rank failed (its error is in its log)")
        if world.main:
            if os.path.exists(target):  # a rerun of the same step, or final/ of a resumed run: replace it
                old = f"{tmp}.old"
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
            _fsync_dir(parent)
    except BaseException as err:
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err, parent, needed_bytes):
            free = shutil.disk_usage(parent).free
            raise OSError(errno.ENOSPC, f"no space left on {parent}: writing {name} needs about "
                          f"{needed_bytes / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free "
                          f"(earlier checkpoints are intact; free space, then resume)") from None
        raise
    finally:
        barrier(world)  # nobody reads the target before rank 0 has renamed it
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
    """An ENOSPC/EDQUOT anywhere in the chain (or in a rank's failure inside torch.distributed.checkpoint's
    CheckpointException), or a write error while less than the size needed is free (torch.save
    reports a full disk as a RuntimeError of its zip writer: "unexpected pos")."""
    for e in chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, (OSError, RuntimeError)) and shutil.disk_usage(folder).free < needed_bytes:
            return True
    return False


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # (a DTensor's numel is the whole tensor's)


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

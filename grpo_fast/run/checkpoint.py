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
                            "config", "world_size"}; with partial rollouts under truncated sampling, where the
                            engine returns kept sets, each member in flight keeps its own (int32 ids + int64
                            offsets): at most 4 k + 8 bytes a token, k = top_k (2 KiB at k = 512), so at most
                            (max_staleness + 1) x prompts_per_generation x num_generations x max_completion_length
                            x 2 KiB: 270 MB for 2 x 8 x 8 x 1024 tokens at max_staleness 1 (sets the trainer
                            rebuilds from the old policy, vLLM on the CPU's, are never saved); a group in flight
                            names its prompt by index, so a prompt's images (a VLM's dataset) would come back with the
                            dataset, but partial rollouts with images are refused when the trainer is built
                            (data/inputs.py: encode_with_images), so none is ever saved
        manifest.json      {"step", "files": {relative path: size in bytes}}: written last (rank 0, once every
                            rank has written), so a folder whose files do not match it was damaged after the
                            write (a truncated copy, a bad disk); final/ has one too ("merged": merged/ in it)

Loading checks first: a checkpoint whose files do not match its manifest is passed over for the previous
intact one with one warning ('latest'), or refused in one line naming the file (a folder named explicitly);
a file that still fails to read (damage that kept its size, or a checkpoint without a manifest) is
named in one line too. Sizes, not checksums: checking them costs nothing at any model size, and a torn
file (the case a kill, a full disk or a truncated copy leaves) changes its size; bit rot that keeps
the size surfaces as a read error of the named file.

Checkpoints of earlier versions (the optimizer inside trainer_state.pt, no distributed/, no manifest)
still load. Many ranks write into one folder: output_dir must be on storage that every node sees.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import warnings
from typing import Optional

import torch

from ..errors import chain

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
DCP_FOLDER = "distributed"
MANIFEST = "manifest.json"
TEMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_warned_fallback: set[tuple[str, str]] = set()  # (newest, chosen) fallbacks this process has announced


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
    from ..distributed import ONE_PROCESS, Parallel, gather_objects

    parallel = parallel or Parallel(model, ONE_PROCESS)
    world = parallel.world

    def write(tmp: str) -> None:
        save_sharded(model, optimizer, os.path.join(tmp, DCP_FOLDER))
        rngs = gather_objects(rng_state(), world)
        _save_whole_model(model, tokenizer, tmp, parallel)
        if world.main:
            torch.save({"state": state, "scheduler": scheduler.state_dict(), "rng": rngs[0], "rng_by_rank": rngs,
                        "config": config, "world_size": world.size}, os.path.join(tmp, STATE_FILE))

    # the HF model + the sharded model + AdamW's two moments (float32 each) + RNG and small state (LoRA: the
    # adapter's file + its sharded copy + its two moments: kilobytes to megabytes, hence sizes in KiB too)
    needed = _tensor_bytes(_saved_parameters(model)) * 4 + _kept_set_bytes(state)
    final = write_atomically(os.path.join(output_dir, f"checkpoint-{step}"), write, needed_bytes=needed, world=world,
                             manifest={"step": step})
    if total_limit is not None and world.main:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_final_model(target: str, model, tokenizer, parallel, merged: bool = False, step: Optional[int] = None) -> str:
    """The trained model alone, as an HF folder at `target`, atomically (every rank calls this). A LoRA
    policy: its adapter (adapter_config.json + adapter_model.safetensors), and with `merged` also
    `merged/`, the base with the adapter merged. step: the trained step, kept in its manifest (a resume
    of a run killed while this was written finds final/ missing or older, and writes it: `final_written`)."""
    from ..models import lora

    merged = merged and lora.is_lora(model)

    def write(tmp: str) -> None:
        _save_whole_model(model, tokenizer, tmp, parallel)
        if merged and parallel.world.main:
            lora.save_merged(model, os.path.join(tmp, "merged"), tokenizer)

    needed = _tensor_bytes(model.parameters()) if merged or not lora.is_lora(model) else _tensor_bytes(_saved_parameters(model))
    return write_atomically(target, write, needed_bytes=needed, world=parallel.world,
                            manifest={"step": step, "merged": merged})


def final_written(target: str, step: int, merged: bool) -> bool:
    """Whether `target` (final/) holds the model of `step` (with merged/ where `merged`) intact, as
    `save_final_model` records it; a final/ of an earlier version (no manifest) counts as not written."""
    record = read_manifest(target)
    return (record is not None and record.get("step") == step and (record.get("merged") or not merged)
            and damage(target) is None)


def _save_whole_model(model, tokenizer, folder: str, parallel) -> None:
    """Rank 0 writes the whole model as an HF folder (FSDP2: gathered to it first, a collective); a LoRA
    policy writes its adapter (megabytes: the base is the model it started from)."""
    from ..models import lora

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
    """Load a `save_sharded` folder into the live model and optimizer, resharded to this world. Strict:
    the folder's tensors are the live model's, one for one (a LoRA adapter of another shape is refused, not
    loaded in part); a file that fails to read is named in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _model_and_optimizer(model, optimizer)  # (initialises AdamW's state, so it has a place to load into)
    try:
        with _no_process_group_notice():
            saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as err:
        raise unreadable(os.path.join(folder, ".metadata"), err) from err
    _check_same_tensors(folder, {k[len("model."):] for k in saved if k.startswith("model.")}, set(state["model"]))
    try:
        with _no_process_group_notice():
            dcp.load(state, checkpoint_id=folder)
    except (Exception, CheckpointException) as err:  # (CheckpointException, a rank's failure, is a BaseException)
        raise unreadable(folder, err) from err
    frozen = any(not p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=frozen, strict=not frozen))


def _check_same_tensors(folder: str, saved: set, live: set) -> None:
    """Refuse a checkpoint whose model tensors are not the live model's: loading the common ones alone
    would train on with the rest silently at their fresh values (a LoRA adapter resumed with other
    target modules kept 4 of its 28 tensors)."""
    missing, unexpected = sorted(live - saved), sorted(saved - live)
    if missing or unexpected:
        raise ValueError(f"{folder} does not hold this model's tensors: {len(missing)} of the model's {len(live)} are not "
                         f"in it (e.g. {missing[:2]}), {len(unexpected)} of its {len(saved)} are not in the model (e.g. "
                         f"{unexpected[:2]}); resume with the options it was saved with (a LoRA adapter keeps its "
                         f"shape: use_peft, lora_r, lora_target_modules, lora_modules_to_save)")


def load_model_and_optimizer(path: str, saved: dict, model, optimizer) -> None:
    """Restore model and optimizer from checkpoint `path` (saved by any number of ranks; `saved`:
    its `load_trainer_state`), resharded to this world."""
    if os.path.isdir(os.path.join(path, DCP_FOLDER)):
        load_sharded(model, optimizer, os.path.join(path, DCP_FOLDER))
    else:  # an earlier version's checkpoint: the HF weights and the optimizer's own state dict
        load_model_weights(model, path)
        try:
            optimizer.load_state_dict(saved["optimizer"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{os.path.join(path, STATE_FILE)}: its optimizer state does not fit this model ({err})") from err


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


def write_atomically(target: str, write, *, needed_bytes: int = 0, world=None, manifest: Optional[dict] = None) -> str:
    """Run `write(tmp_folder)`, fsync what it wrote, then rename the folder to `target`.

    A crash, a kill or a full disk at any moment leaves either the old `target` or the new one,
    never a torn one; the hidden temporary folder of a failed write is removed here, and those of a
    killed process by `remove_stale_temp_folders` at the next start. A full disk is reported as
    "no space left on <folder>" with the size the write needs (`needed_bytes`, an estimate).
    world (many ranks): every rank calls this and writes its part into the same temporary folder;
    rank 0 makes and renames it, and a failure on any rank fails the write on all of them.
    manifest: written by rank 0 as MANIFEST (these fields and every file's size) once every rank has
    written, before the fsync: what loading checks the folder against (`damage`).
    """
    from ..distributed import ONE_PROCESS, any_rank, barrier, gather_objects

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
            if manifest is not None and world.main:
                _write_manifest(tmp, manifest)
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
                          f"{_size(needed_bytes)}, {_size(free)} are free "
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


def _size(n: int) -> str:
    """Bytes for a person: a LoRA checkpoint is kilobytes, a model gigabytes (a fixed MiB said "0 MiB")."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}"
    return f"{n} bytes"


def _kept_set_bytes(state: dict) -> int:
    """The kept sets of the partial rollouts in flight (truncated sampling), in bytes (module docstring's bound)."""
    return sum(t.numel() * t.element_size() for g in state.get("in_flight", ()) for m in g.get("members", ())
               if isinstance(m, dict) and m.get("kept") is not None for t in m["kept"].values())


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


def _write_manifest(folder: str, fields: dict) -> None:
    """MANIFEST with `fields` and the size of every file in `folder` (written last: it lists all the others)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({**fields, "files": dict(sorted(files.items()))}, f, indent=1)


def read_manifest(folder: str) -> Optional[dict]:
    """The folder's manifest; None where it has none (written by an earlier version) or it is unreadable."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def damage(folder: str) -> Optional[str]:
    """What is wrong with a checkpoint (or final/) folder, naming the file; None when every file its
    manifest lists is there with the size written (or it has no manifest: an earlier version's, checked
    as it loads)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    record = read_manifest(folder)
    files = record.get("files") if record is not None else None
    if not isinstance(files, dict):
        return f"{path} is unreadable"
    for name, size in files.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != size:
            return f"{file} holds {os.path.getsize(file)} bytes where {size} were written"
    return None


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoint folders in `output_dir`, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _NAME.match(name))
             and os.path.exists(os.path.join(output_dir, name, STATE_FILE))]
    return [os.path.join(output_dir, name) for _, name in sorted(found)]


def resolve_checkpoint(spec: str, output_dir: str, warn: bool = True) -> str:
    """'latest' -> the newest intact checkpoint in output_dir (damaged newer ones passed over with one
    warning, rank 0, once per process; warn=False: none, for a launcher whose ranks will say it); a folder
    -> itself, refused when damaged. Errors say what was looked at, in one line."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint='latest': no checkpoint-* folder with {STATE_FILE} in {output_dir!r}")
        damaged = []
        for path in reversed(found):
            problem = damage(path)
            if problem is None:
                if damaged and warn and os.environ.get("RANK", "0") == "0" and (found[-1], path) not in _warned_fallback:
                    _warned_fallback.add((found[-1], path))
                    logger.warning("%s: resuming from %s, the newest intact checkpoint", "; ".join(damaged), path)
                return path
            damaged.append(f"{os.path.basename(path)} is damaged ({problem})")
        raise ValueError(f"resume_from_checkpoint='latest': no intact checkpoint in {output_dir!r}: {'; '.join(damaged)}; "
                         f"start a fresh run (--overwrite_output_dir, or another --output_dir)")
    if not os.path.exists(os.path.join(spec, STATE_FILE)):
        raise FileNotFoundError(f"resume_from_checkpoint={spec!r}: not a grpo_fast checkpoint (no {STATE_FILE} there)")
    problem = damage(spec)
    if problem is not None:
        raise ValueError(f"resume_from_checkpoint={spec!r} is damaged: {problem}; resume from another checkpoint "
                         f"(--resume_from_checkpoint, or --resume for the newest intact one)")
    return spec


def unreadable(path: str, err: BaseException) -> ValueError:
    """A checkpoint file that failed to load, as one line naming it (the reader's own message can be a
    page of tracebacks: its first line is kept)."""
    cause = next((e for e in chain(err) if not getattr(e, "failures", None)), err)  # (not DCP's per-rank wrapper)
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "").split(". ")[0]
    return ValueError(f"{path} cannot be read ({type(cause).__name__}: {first[:300]}): the checkpoint is damaged; "
                      f"resume from an earlier one with --resume_from_checkpoint")


def load_model_weights(model, path: str) -> None:
    """Copy the safetensors weights of checkpoint `path` into `model` in place (tied weights allowed)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(load_file(os.path.join(path, f)))
        except Exception as err:
            raise unreadable(os.path.join(path, f), err) from err
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


def load_trainer_state(path: str, **load) -> dict:
    """trainer_state.pt of checkpoint `path` (load: torch.load's options), a read failure named in one line."""
    file = os.path.join(path, STATE_FILE)
    try:  # weights_only=False: the file holds Python RNG state and plain dicts written by save_checkpoint
        return torch.load(file, map_location="cpu", weights_only=False, **load)
    except Exception as err:
        raise unreadable(file, err) from err

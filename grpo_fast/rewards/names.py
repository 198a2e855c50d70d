"""Resolve reward names to reward functions: built-ins by name, user functions by import path."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

from .code import CodeTests
from .judge import JudgeRank, JudgeScore
from .reward_model import RewardModel, is_reward_model_folder
from .steps import chain_steps
from .verifiable import LeadReward, LengthAwareMathReward, boxed_math_reward, format_reward, math_reward

# name -> a reward function, or a factory (class) that builds one from keyword options.
BUILTIN_REWARDS: dict[str, Callable] = {
    "math": math_reward,
    "format": format_reward,
    "math_boxed": boxed_math_reward,
    "math_length": LengthAwareMathReward,
    "lead": LeadReward,
    "chain_steps": chain_steps,  # a step judge (partial_credit_judge), in [0, 1]
    "judge_score": JudgeScore,  # a generative judge (judge=JudgeOptions), in [0, 1] (rewards/judge.py)
    "judge_rank": JudgeRank,  # the same judge scoring a whole group at once (takes_groups)
    "code_tests": CodeTests,  # a program run against unit tests in the sandbox (sandbox=SandboxOptions), in [0, 1]
}


def reward_name(func: Callable) -> str:
    """The name used in metrics (``rewards/<name>/mean``): ``__name__``, else the class name."""
    return getattr(func, "__name__", None) or type(func).__name__


def _build_builtin(name: str, options: dict) -> Callable:
    entry = BUILTIN_REWARDS[name]
    if not inspect.isclass(entry):
        return entry
    # Factories take the options they declare; the rest (meant for other rewards) are ignored.
    params = inspect.signature(entry).parameters
    missing = [p for p, spec in params.items() if spec.default is inspect.Parameter.empty and p not in options]
    if missing:
        raise ValueError(
            f"reward {name!r}: needs the option(s) {missing}, e.g. get_reward_funcs({name!r}, {missing[0]}=...)"
        )
    return entry(**{k: v for k, v in options.items() if k in params})


def _import_function(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'module.path:function'")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            # the `grpo-fast` command does not put the working folder on sys.path as `python` does:
            # a reward module beside the user's data should still import
            if os.getcwd() in sys.path:
                raise
            sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: expected a callable, got {type(obj).__name__}")
    return obj


def get_reward_funcs(names: list[str] | str, **options) -> list[Callable]:
    """Reward functions for ``names``, in order.

    Args:
        names: a list of names, or one string (comma-separated for several). Each is, in this order of
            resolution, a built-in (``"math"``, ``"format"``, ``"math_length"``), a ``"module.path:function"``
            import path, or a folder with a config.json: a reward model (rewards/reward_model.py); or
            already a callable (passed through) or a loaded transformers reward model.
        **options: keyword options for the built-in factories that declare them, e.g.
            ``max_completion_length=256, buffer=64`` for ``"math_length"``, ``judge=JudgeOptions(model=...)``
            for ``"judge_score"`` and ``"judge_rank"``; ignored by the others.

    Raises:
        ValueError: an unknown name (listing the known ones) or an import path that does not resolve.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError(
            f"reward names: expected at least one of {sorted(BUILTIN_REWARDS)} or 'module:function', got none"
        )
    funcs = []
    for name in names:
        if _is_pretrained_model(name):  # (TRL accepts a loaded reward model; a module is callable too)
            funcs.append(RewardModel.from_model(name))
        elif callable(name):
            funcs.append(name)
        elif not isinstance(name, str):
            raise TypeError(f"reward names: expected str or callable entries, got {type(name).__name__}")
        elif name in BUILTIN_REWARDS:
            funcs.append(_build_builtin(name, options))
        elif ":" in name:
            funcs.append(_import_function(name))
        elif is_reward_model_folder(name):
            funcs.append(RewardModel.from_folder(name))
        else:
            raise ValueError(
                f"unknown reward {name!r}: expected one of {sorted(BUILTIN_REWARDS)}, a 'module.path:function' import "
                f"path or a reward model folder (config.json, weights and tokenizer of a sequence-classification model)"
            )
    return funcs


def _is_pretrained_model(obj) -> bool:
    if "transformers" not in sys.modules:  # (nothing can be one before transformers is imported)
        return False
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)

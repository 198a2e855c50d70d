"""A multi_turn run's tools and environments, given as objects (`GRPOTrainer(tools=, environment_factory=)`, TRL's
way) or named by the config (`--tools`, `--environment_factory`): the config names them either way (so a
checkpoint's config says what ran), and both are resolved and checked before any work."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


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


def agent_parts(tools: Optional[Sequence] = None, environment_factory=None, *, tool_names: Optional[Sequence] = None,
                environment_name: Optional[str] = None):
    """(tools, environments) of a multi_turn run, checked and built before any work: the tools (`tools`, else
    `tool_names`: GRPOConfig.tools), the environments (`environment_factory`, else `environment_name`:
    GRPOConfig.environment_factory as module:Class; each built once; None without one)."""
    from . import as_tools
    from .builtin import resolve_tool
    from .environments import Environments

    checked = as_tools(list(tools) if tools is not None else [resolve_tool(name) for name in tool_names or []])
    if environment_factory is None and environment_name:
        environment_factory = resolve_tool(environment_name, what="environment_factory")
    return checked, Environments(environment_factory, checked) if environment_factory is not None else None

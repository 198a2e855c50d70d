"""Rollout modes: how a group is sampled and how its advantages are computed (`GRPOConfig.rollout_mode`).

A mode is one object, a `RolloutMode`, registered by name. It says how many sequences a prompt trains
(`group_size`), the longest of them (`max_sequence_completion`), how it samples (`sample`), how it
turns scored rewards into advantages (`advantages`) and what it supports (`supports_partial_rollouts`,
`shapes_parallel_groups`, `runs_on_many_ranks`, its own `checks` of options). The trainer, the
config and its checks ask the object; none of them compares a mode's name.

The built-in modes, one file each: parallel.py (GRPO's independent completions), early_exit.py
(S-GRPO's serial groups), multi_answer.py (GRPO-MA's thoughts and answers), multi_turn.py (agents:
trajectories that call tools). A new mode is one file
with one class and one `register()` call (tests/test_rollout_mode_registry.py defines one in
the test alone and trains a step with it).

This module is light (no torch at import): `GRPOConfig` reads the registry for its choices.
"""

from __future__ import annotations

import importlib
from typing import Callable

from ...registry import Registry


class RolloutMode:
    """One rollout mode. Subclasses set `name` and override what differs from GRPO's parallel groups."""

    name: str = ""
    summary: str = ""  # what it does, in one line
    supports_partial_rollouts: bool = False  # max_staleness >= 1 (generation/rounds.py continues parallel groups)
    shapes_parallel_groups: bool = False  # takes the options that shape parallel groups' advantages (dynamic
    #   sampling, difficulty weights, noise-aware weights, partial credit, multi-objective aggregation)
    runs_on_many_ranks: bool = False  # under torchrun
    streams_groups: bool = False  # `sample` takes on_group: its groups can be scored as the engine finishes them
    takes_agent: bool = False  # `sample` takes agent= (grpo_fast/generation/agents: the tools, the chat template, the runner)

    def checks(self) -> tuple:
        """config_checks.Combination rows that hold while this mode is chosen (checked before the table's)."""
        return ()

    def group_size(self, c) -> int:
        """Trained sequences per prompt."""
        return c.num_generations

    def graded_per_prompt(self, c) -> int:
        """Graded completions per prompt (what a group-relative reward such as `lead` compares)."""
        return c.num_generations

    def max_sequence_completion(self, c) -> int:
        """Most tokens after the prompt in one trained sequence."""
        return c.max_completion_length

    def group_text(self, c) -> str:
        """How refusals name the trained sequences per prompt."""
        return f"num_generations ({c.num_generations})"

    def sequence_text(self, c, longest: bool = False) -> str:
        """How refusals name the longest trained sequence after the prompt."""
        return f"the {'longest ' if longest else ''}{self.name} sequence"

    def sample(self, engine, tokenizer, prompts: list[list[int]], rows: list[dict], first: int, c, sampling,
               seed: Callable[[], int]):
        """The `Rollouts` of `prompts` (`first`: the position of prompts[0] in the generation batch, which
        seeds it; `seed()`: the next engine call's seed). A mode with `streams_groups` also takes
        `on_group=` and hands it to the engine (prompt i's group: the Rollouts' rows i*G ... (i+1)*G - 1)."""
        raise NotImplementedError

    def advantages(self, batch, c, judge=None, *, prompt_column: str = "prompt", conversational: bool = False,
                   world=None):
        """(advantages [n] float32, stats) of a scored batch; sets `batch.trained_rewards`
        (`c`: train/advantages.AdvantageOptions)."""
        raise NotImplementedError


ROLLOUT_MODES: Registry = Registry("rollout_mode")  # name -> mode, in registration order
register, unregister = ROLLOUT_MODES.register, ROLLOUT_MODES.unregister
rollout_mode = ROLLOUT_MODES.lookup  # the registered mode of a name; an unknown name raises naming the known ones


def modes_where(has: Callable[[RolloutMode], bool]) -> list[str]:
    """The names of the registered modes for which `has(mode)` holds."""
    return [name for name, mode in ROLLOUT_MODES.items() if has(mode)]


# The built-in modes register themselves on import, in this order (the order --help and refusals list them).
for _module in ("parallel", "early_exit", "multi_answer", "multi_turn"):
    importlib.import_module(f".{_module}", __name__)

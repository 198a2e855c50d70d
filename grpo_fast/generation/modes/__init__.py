"""Rollout modes: how a group is sampled and how its advantages are computed (`GRPOConfig.rollout_mode`).

A mode is one object, a `RolloutMode`, registered by name. It says how many sequences a prompt trains
(`group_size`), the longest of them (`max_sequence_completion`), how it samples (`sample`, reading its
options record `options`), how it turns scored rewards into advantages (`advantages`), what it supports
(`supports_partial_rollouts`, `shapes_parallel_groups`, `runs_on_many_ranks`, its own `checks` of options)
and, with partial rollouts, what a round's members are and how they advance (`round_members`). The trainer,
the config and its checks ask the object; none of them compares a mode's name.

The built-in modes, one file each (its sampling, its advantages, what it supports): parallel.py (GRPO's
independent completions), early_exit.py (S-GRPO's serial groups), multi_answer.py (GRPO-MA's thoughts and
answers), multi_turn.py (agents: trajectories that call tools). A new mode is one file with one class and
one `register()` call (tests/test_rollout_mode_registry.py defines one in the test alone and trains a step
with it, and one that also runs partial rollouts).

This module is light (no torch at import): `GRPOConfig` reads the registry for its choices.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ...bounds import INTEGER_AT_LEAST_1, Bounds
from ...options import option, options_record
from ...registry import Registry

ROLLOUT_MODES: Registry = Registry("rollout_mode")  # name -> mode, in registration order
register, unregister = ROLLOUT_MODES.register, ROLLOUT_MODES.unregister
rollout_mode = ROLLOUT_MODES.lookup  # the registered mode of a name; an unknown name raises naming the known ones


@options_record
@dataclass(frozen=True)
class ModeOptions:
    """What a rollout mode's `sample` reads (the record of the modes that add no options of their own; a mode
    with options of its own has its record, which mirrors these: `RolloutMode.options`)."""

    rollout_mode: str = option(
        "parallel", "How a group is sampled. parallel: num_generations independent completions per prompt. "
        "early_exit (S-GRPO): one full completion per prompt, cut at early_exit_points positions, each cut answered "
        "after early_exit_text; the serial group (the cuts, shortest first, then the full completion) gets decaying "
        "rewards 1/2^(i-1) for its i-th correct member, advantages r - mean(r); num_generations must be "
        "early_exit_points + 1. multi_answer (GRPO-MA): num_generations thoughts per prompt (ended at thought_end or "
        "max_thought_length tokens), answers_per_thought answers each; thoughts train with the mean-answer-reward "
        "advantage, answers (thought tokens masked) with the group advantage over the prompt's answers.",
        ROLLOUT_MODES)
    num_generations: int = option(8, "Completions sampled per prompt (the group size G).",
                                  bounds=Bounds(low=2, integer=True, note=" (a group needs a baseline)"))
    max_completion_length: int = option(64, "Most tokens generated per completion.", bounds=INTEGER_AT_LEAST_1)


class RolloutMode:
    """One rollout mode. Subclasses set `name` and override what differs from GRPO's parallel groups."""

    name: str = ""
    summary: str = ""  # what it does, in one line
    options: type = ModeOptions  # the options record `sample` reads (built once from the config: `from_config`)
    supports_partial_rollouts: bool = False  # max_staleness >= 1: rounds of `round_members` (generation/rounds.py)
    shapes_parallel_groups: bool = False  # takes the options that shape parallel groups' advantages (dynamic
    #   sampling, difficulty weights, noise-aware weights, partial credit, multi-objective aggregation)
    runs_on_many_ranks: bool = False  # under torchrun
    streams_groups: bool = False  # `sample` takes on_group: its groups can be scored as the engine finishes them
    takes_agent: bool = False  # `sample` takes agent= (grpo_fast/generation/agents: the tools, the chat template, the runner)
    carries_routing: bool = False  # its batch keeps the engine's routing records (Rollouts.routed_experts: routing replay)
    # its batch keeps the kept sets an engine returns under truncated sampling (Rollouts.kept); else the trainer
    # rebuilds them from the old policy (train/kept_sets.py)
    carries_kept_sets: bool = False
    takes_images: bool = False  # `sample` takes images= (a VLM's prompts: one generation.images.ImagePrompt each)

    def checks(self) -> tuple:
        """`options.Combination` rows that hold while this mode is chosen (config_checks checks them before its table's)."""
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
        """The `Rollouts` of `prompts` (`c`: the mode's `options` record; `first`: the position of prompts[0] in
        the generation batch, which seeds it; `seed()`: the next engine call's seed). A mode with
        `streams_groups` also takes `on_group=` and hands it to the engine (prompt i's group: the Rollouts'
        rows i*G ... (i+1)*G - 1); one with `takes_agent` takes `agent=`."""
        raise NotImplementedError

    def advantages(self, batch, c, judge=None, *, world=None):
        """(advantages [n] float32, stats) of a scored batch; sets `batch.trained_rewards` (`c`: the advantages
        stage's AdvantageOptions; judge(batch) -> [n, 1] rewards: the partial-credit judge's scores, where
        there is one; world: this rank's place, where a statistic spans the ranks)."""
        raise NotImplementedError

    def round_members(self, engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], c, sampling, *,
                      agent=None, on_complete=None):
        """With `supports_partial_rollouts`: what a partial-rollout round's members are and how they advance
        (`c`: generation/rounds.RoundOptions; prompt_ids, rows: the training prompts, by index). Plain
        completions by default, `num_generations` a group (`rounds.Completions`: continued in the engine's
        request loop; on_complete(group, its Rollouts) as each group's last member ends)."""
        from ..rounds import Completions

        return Completions(engine, tokenizer, prompt_ids, rows, sampling=sampling, budget=c.max_completion_length,
                           on_complete=on_complete)


def modes_where(has: Callable[[RolloutMode], bool]) -> list[str]:
    """The names of the registered modes for which `has(mode)` holds."""
    return [name for name, mode in ROLLOUT_MODES.items() if has(mode)]


def sample_groups(mode: RolloutMode, engine, tokenizer, prompts: list[list[int]], rows: list[dict], first: int, c,
                  sampling, seed: Callable[[], int], *, on_group=None, agent=None, images=None):
    """`mode.sample` with what it takes: on_group where the caller streams groups (the mode must stream them),
    agent where the mode takes one, images (prompts with images) where it takes them (else refused by name)."""
    extra = {"on_group": on_group} if on_group is not None else {}
    assert not extra or mode.streams_groups, f"rollout mode {mode.name!r} does not stream its groups"
    if mode.takes_agent:
        extra["agent"] = agent
    if images is not None:
        if not mode.takes_images:
            raise ValueError(f"rollout_mode={mode.name!r} does not take prompts with images; use one of "
                             f"{modes_where(lambda m: m.takes_images)}")
        extra["images"] = images
    return mode.sample(engine, tokenizer, prompts, rows, first, c, sampling, seed, **extra)


# The built-in modes register themselves on import, in this order (the order --help and refusals list them).
for _module in ("parallel", "early_exit", "multi_answer", "multi_turn"):
    importlib.import_module(f".{_module}", __name__)

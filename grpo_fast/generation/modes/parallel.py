"""GRPO's parallel groups: num_generations independent completions per prompt; group advantages of the
(weighted) rewards, shaped by the options for parallel groups (train/advantages.py)."""

from __future__ import annotations

from . import RolloutMode, register


class Parallel(RolloutMode):
    name = "parallel"
    summary = "num_generations independent completions per prompt"
    supports_partial_rollouts = True
    shapes_parallel_groups = True
    runs_on_many_ranks = True
    streams_groups = True

    def sequence_text(self, c, longest=False) -> str:
        return "max_completion_length"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed, on_group=None):
        from ..batch import from_engine
        from ..engines.base import prompt_seeds

        groups = engine.generate(prompts, n=c.num_generations, max_new_tokens=c.max_completion_length,
                                 sampling=sampling, seed=prompt_seeds(seed(), len(prompts), first), on_group=on_group)
        return from_engine(groups, prompts, rows)

    def advantages(self, batch, c, judge=None, *, prompt_column="prompt", conversational=False, world=None):
        from ...distributed import ONE_PROCESS
        from ...train.advantages import group_advantages

        return group_advantages(batch, c, judge, prompt_column=prompt_column, conversational=conversational,
                                world=world or ONE_PROCESS)


register(Parallel())

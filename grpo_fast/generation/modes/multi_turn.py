"""Agents (rollout_mode=multi_turn): num_generations trajectories per prompt, each the model's turns and
the results of the tools it calls, trained as one completion with the tool tokens masked out of the
loss (grpo_fast/generation/agents). Switched on by giving tools (`GRPOTrainer(tools=...)`, `--tools`); group
advantages as GRPO's parallel groups, of the outcome's rewards."""

from __future__ import annotations

from ...options import Combination
from . import register
from .parallel import Parallel


class MultiTurn(Parallel):
    """Parallel groups (their advantages) whose members are trajectories, also with partial rollouts (their round
    members: agents/rounds.py) and on many ranks; streamed scoring and the options that shape parallel groups'
    advantages not yet."""

    name = "multi_turn"
    summary = "agents: num_generations trajectories per prompt, the model calling tools over several turns"
    takes_agent = True
    supports_partial_rollouts = True  # (trajectories carried over mid-turn and between turns: agents/rounds.py)
    shapes_parallel_groups = False
    runs_on_many_ranks = True  # (each rank runs its share's trajectories, environments and tools)
    streams_groups = False
    carries_routing = False  # (a trajectory's tool results and template tokens between turns: no engine step)
    carries_kept_sets = False

    def checks(self) -> tuple:
        return (
            Combination("tools", None, lambda c: (
                "at least one tool with rollout_mode='multi_turn' (its trajectories call tools): give --tools "
                "calculator,module:function, --environment_factory module:Class, or GRPOTrainer(tools=[...])"),
                lambda c: not c.tools and not c.environment_factory, ""),
        )

    def sequence_text(self, c, longest=False) -> str:
        return "max_completion_length (every completion token: the model's turns and the tool results)"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed, on_group=None, agent=None):
        from ..engines.base import prompt_seeds

        assert agent is not None, "rollout_mode='multi_turn' samples with the run's Agent (GRPOTrainer builds it)"
        return agent.rollouts(engine, tokenizer, prompts, rows, prompt_seeds(seed(), len(prompts), first),
                              c.num_generations, sampling=sampling, max_completion_length=c.max_completion_length)

    def round_members(self, engine, tokenizer, prompt_ids, rows, c, sampling, *, agent=None, on_complete=None):
        from ..agents.rounds import Trajectories

        assert agent is not None, "rollout_mode='multi_turn' runs its rounds with the run's Agent (GRPOTrainer builds it)"
        return Trajectories(agent, engine, tokenizer, prompt_ids, rows, sampling=sampling,
                            max_completion_length=c.max_completion_length)


register(MultiTurn())

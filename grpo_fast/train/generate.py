"""The generate stage: the next prompts in the seeded data order, this rank's share of them, the
engine's completions (by the rollout mode, or a partial-rollout round), and DAPO's dynamic sampling,
which scores as it samples and draws more prompts until enough groups carry a signal.

Seeds come from the run seed and counters kept in `TrainState` (`cursor`, `epoch`,
`generation_calls`), so a resumed run draws the same prompts with the same sampling seeds.
How a group is sampled is its rollout mode's (`grpo_fast.generation.modes`, one registered object per mode:
`sample` asks it); `partial_rollouts.py` runs rounds that never wait for their longest completion.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..distributed import World
from ..generation import rounds as partial_rollouts
from ..generation.agents import rounds as agent_rounds
from ..generation.agents import tool_metrics
from ..generation.batch import Rollouts, from_engine
from ..generation.engines.base import SamplingOptions, hashed_seed, prompt_seeds
from ..generation.modes import rollout_mode
from ..reporting.metrics import timed
from ..rewards.names import reward_name
from .score import GroupScorer, Scores, conversational, counter_metrics, score, zero_std_groups

# Seeds derived from the run seed: seed * P + counter, with P a prime larger than any counter a run
# reaches, so two runs' seeds (seed s, counter k) and (s', k') never coincide unless s = s', k = k'
# (a plain seed + counter would give run 42's step 1 the seed of run 43's step 0).
_SAMPLING_SEED_PRIME = 100_003  # > the engine calls of any run
_EPOCH_SEED_PRIME = 1_000_003  # > the epochs of any run


@dataclass(frozen=True)
class TrainData:
    """The training prompts, built once: dataset rows, their token ids, and what grades them."""

    rows: list
    prompt_ids: list
    reward_funcs: list
    judge: Optional[Callable] = None  # SGPO's partial-credit judge (the advantages stage's)
    agent: Optional[object] = None  # multi_turn: the tools, chat template and tool runner (grpo_fast/generation/agents)


@dataclass(frozen=True)
class Generated:
    """What the stage returns: the scored generation batch, its metrics, and its time parts."""

    batch: Rollouts
    metrics: dict  # frac_reward_zero_std, dynamic_sampling/rounds, rollout/*
    times: dict  # time/generate, time/reward


# ---- data order and seeds --------------------------------------------------------------------


def sampling_seed(seed: int, generation_calls: int) -> int:
    return seed * _SAMPLING_SEED_PRIME + generation_calls


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * _EPOCH_SEED_PRIME + epoch)).tolist()


def next_prompts(state, k: int, n: int, config) -> list[int]:
    """The next k prompt indices (of n) in the seeded per-epoch order (wrapping into the next epoch)."""
    out = []
    while len(out) < k:
        order = epoch_order(n, config.seed, state.epoch, config.shuffle_dataset)
        take = order[state.cursor : state.cursor + k - len(out)]
        out += take
        state.cursor += len(take)
        if state.cursor >= n:
            state.epoch, state.cursor = state.epoch + 1, 0
    return out


def next_seed(state, config) -> int:
    """The sampling seed of the next engine call (each call its own; a resumed run continues the sequence)."""
    state.generation_calls += 1
    return sampling_seed(config.seed, state.generation_calls)


def rank_share(prompt_index: list[int], world: World) -> tuple[list[int], int]:
    """This rank's equal share of the generation batch's prompts (whole groups stay on one rank),
    and the position of its first prompt in the batch (which seeds it)."""
    k = len(prompt_index) // world.size
    return prompt_index[world.rank * k : (world.rank + 1) * k], world.rank * k


# ---- sampling --------------------------------------------------------------------------------


def sample(engine, tokenizer, prompts: list[list[int]], rows: list[dict], first: int, config, sampling: SamplingOptions,
           seed: Callable[[], int], on_group=None, agent=None) -> Rollouts:
    """The engine's completions of `prompts` as the rollout mode samples them (`seed()`: the next call's seed;
    on_group: handed to the engine where the mode streams its groups; agent: to a mode that takes it)."""
    mode = rollout_mode(config.rollout_mode)
    extra = {"on_group": on_group} if on_group is not None else {}
    assert not extra or mode.streams_groups, f"rollout mode {mode.name!r} does not stream its groups"
    if mode.takes_agent:
        extra["agent"] = agent
    return mode.sample(engine, tokenizer, prompts, rows, first, config, sampling, seed, **extra)


def group_scorer(engine, data: TrainData, prompt_index: list[int], config) -> Optional[GroupScorer]:
    """A scorer of the groups as the engine finishes them, where both the engine (vLLM) and the rollout mode
    stream groups; None elsewhere (the batch is scored after sampling)."""
    if not (engine.streams_groups and rollout_mode(config.rollout_mode).streams_groups):
        return None
    prompts, rows = [data.prompt_ids[i] for i in prompt_index], [data.rows[i] for i in prompt_index]

    def make_batch(indices: list[int], groups: list) -> Rollouts:
        return from_engine(groups, [prompts[i] for i in indices], [rows[i] for i in indices])

    return GroupScorer(data.reward_funcs, make_batch, config.prompt_column,
                       conversational(rows[0][config.prompt_column]), group_size=config.group_size,
                       timeout=config.reward_timeout)


def generate(engine, tokenizer, data: TrainData, prompt_index: list[int], first: int, state, config,
             sampling: SamplingOptions, engine_weights, on_group=None) -> Rollouts:
    """Sample the prompts `prompt_index` (sleep mode: the engine woken for it, put back to sleep after)."""
    prompts, rows = [data.prompt_ids[i] for i in prompt_index], [data.rows[i] for i in prompt_index]
    if config.vllm_enable_sleep_mode:
        engine.wake()
    with engine_weights():
        batch = sample(engine, tokenizer, prompts, rows, first, config, sampling, lambda: next_seed(state, config),
                       on_group, data.agent)
    if config.vllm_enable_sleep_mode:  # free the engine's memory for the training passes (GPU)
        engine.sleep()
    return batch


def partial_round(engine, tokenizer, data: TrainData, state, config,
                  sampling: SamplingOptions) -> tuple[Rollouts, dict, Optional[Callable[[], Scores]]]:
    """Partial rollouts: drop the too-stale groups, run a round (it draws new prompts as slots free up);
    (the groups to train, the round's metrics, where the engine streams a call that waits for their
    scores: each group was scored as its last member finished, while the round ran on; else None)."""
    c = config
    pool, dropped = partial_rollouts.drop_stale(state.in_flight, state.policy_version, c.max_staleness)
    if data.agent is not None:
        return agent_round(engine, tokenizer, data, state, c, sampling, pool, dropped)

    def draw(n: int) -> list[dict]:  # n new groups: the next prompts of the data order, their seeds
        return partial_rollouts.new_groups(next_prompts(state, n, len(data.rows), c),
                                           prompt_seeds(next_seed(state, c), n), c.num_generations)

    if c.vllm_enable_sleep_mode:
        engine.wake()
    scorer = None
    if engine.streams_groups:
        scorer = GroupScorer(data.reward_funcs, lambda keys, groups: Rollouts.concat(groups), c.prompt_column,
                             conversational(data.rows[0][c.prompt_column]), group_size=c.group_size,
                             timeout=c.reward_timeout)
    try:
        batch, state.in_flight, stats, trained = partial_rollouts.run_round(
            engine, tokenizer, pool, draw, data.prompt_ids, data.rows, c, sampling=sampling,
            version=state.policy_version,
            on_complete=(lambda g, group: scorer.on_group(id(g), group)) if scorer is not None else None)
    except BaseException:
        if scorer is not None:
            scorer.close()
        raise
    if c.vllm_enable_sleep_mode:
        engine.sleep()
    stats["rollout/dropped_stale"] = dropped
    if scorer is None:
        return batch, stats, None
    G = c.group_size
    # a group complete before this round: its scores from the round that completed it (kept on the group,
    # in memory only: after a resume it is scored again, to the same values); else scored at the end
    known = {id(g): g.scores for g in trained if g.scores is not None}
    late = {id(g): batch.select(range(k * G, (k + 1) * G)) for k, g in enumerate(trained)}

    def scores() -> Scores:
        out = scorer.finish([id(g) for g in trained], late=late, known=known)
        for g in state.in_flight:  # complete, not trained yet: keep what it scored
            if id(g) in scorer.scored:
                g.scores = scorer.scored[id(g)]
        return out

    return batch, stats, scores


def agent_round(engine, tokenizer, data: TrainData, state, config, sampling: SamplingOptions, pool: list,
                dropped: int) -> tuple[Rollouts, dict, None]:
    """Partial rollouts of an agent (agents/rounds.py): trajectories carried over between rounds; a group in
    flight read back from a checkpoint made whole first (its environments rebuilt, `Agent.restore`)."""
    c, agent = config, data.agent
    loop = agent.loop(engine, tokenizer, sampling=sampling, max_completion_length=c.max_completion_length)
    if agent.environments is not None:  # (the instances of trained or dropped groups are free again)
        agent.environments.release_all_but([t.environment for g in pool for t in g.members])
    restarted = sum(not agent.restore(t, data.rows[g.prompt], loop) for g in pool for t in g.members)

    def draw(n: int) -> list:  # n new groups of trajectories: the next prompts of the data order, their seeds
        return partial_rollouts.new_groups(
            next_prompts(state, n, len(data.rows), c), prompt_seeds(next_seed(state, c), n), c.num_generations,
            lambda p, seed, j: agent.trajectory(data.prompt_ids[p], data.rows[p], hashed_seed(seed, j)))

    if c.vllm_enable_sleep_mode:
        engine.wake()
    trained, state.in_flight, stats = agent_rounds.run_round(loop, pool, draw, c, version=state.policy_version)
    if c.vllm_enable_sleep_mode:
        engine.sleep()
    batch = agent.as_rollouts([t for g in trained for t in g.members],
                              [data.rows[g.prompt] for g in trained for _ in g.members], tokenizer, loop.waiting_seconds)
    return batch, {**stats, "rollout/dropped_stale": dropped, "rollout/restarted_trajectories": restarted}, None


# ---- the stage: generate and score, with dynamic sampling ------------------------------------


def generation_batch(engine, tokenizer, data: TrainData, state, config, sampling: SamplingOptions, world: World,
                     engine_weights=contextlib.nullcontext) -> Generated:
    """Sample the generation batch and score it. With dynamic sampling (DAPO), groups whose
    rewards all agree are dropped and more prompts sampled, up to dynamic_sampling_max_rounds."""
    c, G, times = config, config.group_size, {}
    wanted, kept, sampled_groups, zero_groups, rounds = c.prompts_per_generation, [], 0, 0, 0
    round_stats = dict.fromkeys(("rollout/carried_over", "rollout/staleness_mean", "rollout/staleness_max",
                                 "rollout/dropped_stale", "rollout/busy_fraction"), 0)  # synchronous: zeros
    generated = 0
    while True:
        finish = None  # where groups were scored as the engine finished them: waits for their scores
        with timed(times, "time/generate"):
            if c.max_staleness:
                part, round_stats, finish = partial_round(engine, tokenizer, data, state, c, sampling)
            else:
                more = world.size * (wanted - sum(len(k) // G for k in kept))
                index, first = rank_share(next_prompts(state, more, len(data.rows), c), world)
                scorer = group_scorer(engine, data, index, c)  # (vLLM: groups scored while the rest decode)
                try:
                    part = generate(engine, tokenizer, data, index, first, state, c, sampling, engine_weights,
                                    scorer.on_group if scorer is not None else None)
                except BaseException:
                    if scorer is not None:
                        scorer.close()
                    raise
                if scorer is not None:
                    finish = functools.partial(scorer.finish, range(len(part) // G))
                generated += sum(len(ids) for ids in part.completion_ids)
                round_stats["rollout/generated_tokens"] = generated
        with timed(times, "time/reward"):  # (what scoring adds after decoding: the early groups' time is hidden)
            scores = finish() if finish is not None else score(
                data.reward_funcs, part, c.prompt_column, conversational(part.rows[0][c.prompt_column]),
                group_size=G, timeout=c.reward_timeout)
            part.rewards = scores.rewards
            part.stats.update(counter_metrics([*data.reward_funcs, data.judge]))
            part.stats["rewards_non_finite"] = scores.non_finite
            if c.reward_timeout is not None:  # (counted, and logged, where calls can time out)
                part.stats.update({f"rewards/{reward_name(f)}/timeouts": scores.timeouts.get(reward_name(f), 0)
                                   for f in data.reward_funcs})
        zero = zero_std_groups(part.rewards, c.reward_weights, G)
        sampled_groups, zero_groups, rounds = sampled_groups + len(zero), zero_groups + int(zero.sum()), rounds + 1
        if not c.dynamic_sampling:
            kept = [part]
            break
        keep = [g * G + j for g in range(len(zero)) if not zero[g] for j in range(G)]
        if keep:
            kept.append(part.select(keep))
        if sum(len(k) for k in kept) >= wanted * G or rounds > c.dynamic_sampling_max_rounds:
            break
    batch = Rollouts.concat(kept) if kept else part  # nothing informative: train on the last round
    if len(batch) > wanted * G:
        batch = batch.select(range(wanted * G))
    metrics = {"frac_reward_zero_std": zero_groups / max(sampled_groups, 1), "dynamic_sampling/rounds": rounds,
               **round_stats, **tool_metrics(batch.stats, world)}
    return Generated(batch=batch, metrics=metrics, times=times)

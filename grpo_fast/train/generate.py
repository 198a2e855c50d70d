"""The generate stage: the next prompts in the seeded data order, this rank's share of them, the
engine's completions as the rollout mode samples them (or a round of partial rollouts), scored, and DAPO's
dynamic sampling, which scores as it samples and draws more prompts until enough groups carry a signal.

Seeds come from the run seed and counters kept in `TrainState` (`cursor`, `epoch`,
`generation_calls`), so a resumed run draws the same prompts with the same sampling seeds.
How a group is sampled is its rollout mode's (`grpo_fast.generation.modes`, one registered object per mode);
rounds that never wait for their longest completion are `grpo_fast.generation.rounds`'. Where the engine
and the mode stream groups, each group is scored as it finishes (`score.GroupScorer`) while the rest decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..bounds import INTEGER_AT_LEAST_1
from ..data.inputs import InputOptions, thought_end
from ..distributed import World
from ..generation import rounds
from ..generation.agents import tool_metrics
from ..generation.batch import Rollouts, from_engine
from ..generation.engines.base import SamplingOptions, prompt_seeds
from ..generation.modes import rollout_mode, sample_groups
from ..generation.rounds import RoundOptions
from ..options import mirror, option, options_record, read_config
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
    images: Optional[list] = None  # a dataset with images: each prompt's ImagePrompt (None: text only; generation/images.py)


@options_record
@dataclass(frozen=True)
class GenerateOptions:
    """What the generate stage reads, built once (`from_config`): the data order, dynamic sampling, what
    scoring reads, and the records of the rollout mode (its `options`) and of partial rollouts."""

    seed: int = mirror(42)
    shuffle_dataset: bool = mirror(True)
    dynamic_sampling: bool = option(False, "DAPO dynamic sampling: drop groups whose rewards all agree and sample "
                                    "more prompts until the batch is full.")
    dynamic_sampling_max_rounds: int = option(4, "Most extra generation rounds dynamic sampling runs per batch before "
                                              "training on what it has.", bounds=INTEGER_AT_LEAST_1)
    prompt_column: str = mirror("prompt")
    reward_weights: Optional[list] = mirror(None)
    reward_timeout: Optional[float] = mirror(None)
    rollout_mode: str = mirror("parallel")
    group_size: int = 8  # (GRPOConfig.group_size: trained sequences per prompt, as the mode samples them)
    prompts_per_generation: int = 8  # (GRPOConfig.prompts_per_generation)
    mode: Any = None  # the rollout mode's options record (`RolloutMode.options`): what its sampling reads
    rounds: Optional[RoundOptions] = None  # partial rollouts' (its max_staleness 0: batches sampled whole)

    @classmethod
    def from_config(cls, config) -> "GenerateOptions":
        record = rollout_mode(config.rollout_mode).options
        # multi_answer's thought_end as the inputs resolve it (None: the built-in task's own)
        resolved = ({"thought_end": thought_end(InputOptions.from_config(config))}
                    if "thought_end" in {f.name for f in dataclasses.fields(record)} else {})
        mode = record.from_config(config, **resolved)
        return read_config(cls, config, group_size=config.group_size, prompts_per_generation=config.prompts_per_generation,
                           mode=mode, rounds=RoundOptions.from_config(config, prompts_per_generation=config.prompts_per_generation))


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


def next_prompts(state, k: int, n: int, options: GenerateOptions) -> list[int]:
    """The next k prompt indices (of n) in the seeded per-epoch order (wrapping into the next epoch)."""
    out = []
    while len(out) < k:
        order = epoch_order(n, options.seed, state.epoch, options.shuffle_dataset)
        take = order[state.cursor : state.cursor + k - len(out)]
        out += take
        state.cursor += len(take)
        if state.cursor >= n:
            state.epoch, state.cursor = state.epoch + 1, 0
    return out


def next_seed(state, options: GenerateOptions) -> int:
    """The sampling seed of the next engine call (each call its own; a resumed run continues the sequence)."""
    state.generation_calls += 1
    return sampling_seed(options.seed, state.generation_calls)


def rank_share(prompt_index: list[int], world: World) -> tuple[list[int], int]:
    """This rank's equal share of the generation batch's prompts (whole groups stay on one rank),
    and the position of its first prompt in the batch (which seeds it)."""
    k = len(prompt_index) // world.size
    return prompt_index[world.rank * k : (world.rank + 1) * k], world.rank * k


# ---- sampling, scored as it goes where the engine streams ------------------------------------


def _scorer(data: TrainData, options: GenerateOptions, first_row: dict, make_batch: Callable) -> GroupScorer:
    """A scorer of groups as the engine finishes them (make_batch(keys, groups) -> their Rollouts)."""
    return GroupScorer(data.reward_funcs, make_batch, options.prompt_column, conversational(first_row[options.prompt_column]),
                       group_size=options.group_size, timeout=options.reward_timeout)


@contextlib.contextmanager
def _closed_on_error(scorer: Optional[GroupScorer]):
    """The scorer's worker let go where sampling fails (nothing will be finished)."""
    try:
        yield
    except BaseException:
        if scorer is not None:
            scorer.close()
        raise


def sampled(engine, tokenizer, data: TrainData, prompt_index: list[int], first: int, state, options: GenerateOptions,
            sampling: SamplingOptions, engine_weights) -> tuple[Rollouts, Optional[Callable[[], Scores]]]:
    """The prompts `prompt_index` sampled as the rollout mode samples them (`first`: the batch position of the
    first), and, where both the engine (vLLM) and the mode stream groups, a call that waits for their scores
    (each group scored as it finished, while the rest decoded); else None."""
    mode = rollout_mode(options.rollout_mode)
    prompts, rows = [data.prompt_ids[i] for i in prompt_index], [data.rows[i] for i in prompt_index]
    scorer = None
    if engine.streams_groups and mode.streams_groups:
        scorer = _scorer(data, options, rows[0], lambda indices, groups: from_engine(
            groups, [prompts[i] for i in indices], [rows[i] for i in indices]))
    with _closed_on_error(scorer), engine_weights():
        batch = sample_groups(mode, engine, tokenizer, prompts, rows, first, options.mode, sampling,
                              lambda: next_seed(state, options), on_group=scorer.on_group if scorer is not None else None,
                              agent=data.agent, images=[data.images[i] for i in prompt_index] if data.images else None)
    if scorer is None:
        return batch, None
    return batch, functools.partial(scorer.finish, range(len(batch) // options.group_size))


def scored_round(engine, tokenizer, data: TrainData, state, options: GenerateOptions,
                 sampling: SamplingOptions) -> tuple[Rollouts, dict, Optional[Callable[[], Scores]]]:
    """Partial rollouts: a round of the rollout mode's members (generation/rounds.py; it draws new prompts as slots
    free up); (the groups to train, the round's metrics, where the engine and the mode stream groups a call that
    waits for their scores: each group was scored as its last member finished, while the round ran on; else None)."""
    mode = rollout_mode(options.rollout_mode)
    scorer = None
    if engine.streams_groups and mode.streams_groups:
        scorer = _scorer(data, options, data.rows[0], lambda keys, groups: Rollouts.concat(groups))
    members = mode.round_members(engine, tokenizer, data.prompt_ids, data.rows, options.rounds, sampling, agent=data.agent,
                                 on_complete=(lambda g, group: scorer.on_group(id(g), group)) if scorer is not None else None)

    def draw(n: int) -> tuple[list[int], list[int]]:  # n new groups' prompts (the data order's next) and seeds
        return next_prompts(state, n, len(data.rows), options), prompt_seeds(next_seed(state, options), n)

    with _closed_on_error(scorer):
        batch, state.in_flight, stats, trained = rounds.partial_round(
            engine, members, state.in_flight, draw, options.rounds, version=state.policy_version)
    if scorer is None:
        return batch, stats, None
    G = options.group_size
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


# ---- the stage: generate and score, with dynamic sampling ------------------------------------


def generation_batch(engine, tokenizer, data: TrainData, state, options: GenerateOptions, sampling: SamplingOptions,
                     world: World, engine_weights=contextlib.nullcontext) -> Generated:
    """Sample the generation batch and score it. With dynamic sampling (DAPO), groups whose
    rewards all agree are dropped and more prompts sampled, up to dynamic_sampling_max_rounds."""
    o, G, times = options, options.group_size, {}
    wanted, kept, sampled_groups, zero_groups, rounds_run = o.prompts_per_generation, [], 0, 0, 0
    round_stats = dict.fromkeys(("rollout/carried_over", "rollout/staleness_mean", "rollout/staleness_max",
                                 "rollout/dropped_stale", "rollout/busy_fraction"), 0)  # synchronous: zeros
    generated = 0
    while True:
        with timed(times, "time/generate"):
            if o.rounds.max_staleness:
                part, round_stats, finish = scored_round(engine, tokenizer, data, state, o, sampling)
            else:
                more = world.size * (wanted - sum(len(k) // G for k in kept))
                index, first = rank_share(next_prompts(state, more, len(data.rows), o), world)
                part, finish = sampled(engine, tokenizer, data, index, first, state, o, sampling, engine_weights)
                generated += sum(len(ids) for ids in part.completion_ids)
                round_stats["rollout/generated_tokens"] = generated
        with timed(times, "time/reward"):  # (what scoring adds after decoding: the early groups' time is hidden)
            scores = finish() if finish is not None else score(
                data.reward_funcs, part, o.prompt_column, conversational(part.rows[0][o.prompt_column]),
                group_size=G, timeout=o.reward_timeout)
            part.rewards = scores.rewards
            part.stats.update(counter_metrics([*data.reward_funcs, data.judge]))
            part.stats["rewards_non_finite"] = scores.non_finite
            if o.reward_timeout is not None:  # (counted, and logged, where calls can time out)
                part.stats.update({f"rewards/{reward_name(f)}/timeouts": scores.timeouts.get(reward_name(f), 0)
                                   for f in data.reward_funcs})
        zero = zero_std_groups(part.rewards, o.reward_weights, G)
        sampled_groups, zero_groups, rounds_run = sampled_groups + len(zero), zero_groups + int(zero.sum()), rounds_run + 1
        if not o.dynamic_sampling:
            kept = [part]
            break
        keep = [g * G + j for g in range(len(zero)) if not zero[g] for j in range(G)]
        if keep:
            kept.append(part.select(keep))
        if sum(len(k) for k in kept) >= wanted * G or rounds_run > o.dynamic_sampling_max_rounds:
            break
    batch = Rollouts.concat(kept) if kept else part  # nothing informative: train on the last round
    if len(batch) > wanted * G:
        batch = batch.select(range(wanted * G))
    metrics = {"frac_reward_zero_std": zero_groups / max(sampled_groups, 1), "dynamic_sampling/rounds": rounds_run,
               **round_stats, **tool_metrics(batch.stats, world)}
    return Generated(batch=batch, metrics=metrics, times=times)

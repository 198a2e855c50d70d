"""Partial rollouts (`max_staleness >= 1`): a round stops once enough groups are complete; the
completions still running carry over and continue in the next round, under the new weights.

The pool of groups in flight lives in `TrainState.in_flight` as `Group` records, each holding its
`Member`s: a member's tokens, the sampling log-prob of each, and the policy version (weight syncs so
far) that sampled each. A checkpoint holds them as plain dicts (`to_dict`/`from_dict`: a group
`{"prompt": index, "seed": int, "members": [member, ...]}`, a member
`{"ids": [...], "logp": [...], "ver": [...], "finish": None | "stop" | "length"}`, the format every
version wrote, and `"kept": {"ids", "offsets"}` where the engine returned the kept sets of truncated sampling:
generation/truncation.py), so a resumed run continues the very same completions.

Each round:
1. groups whose oldest token would train more than `max_staleness` versions behind the policy are
   dropped whole (`rollout/dropped_stale`, in groups; the rules of `run_round` make it rare);
2. every unfinished member runs as one request: prompt + its tokens so far, the remaining budget
   (after a weight sync the prefix cache is empty, so a continuation re-prefills its prefix:
   `rollout/reprefill_tokens`), until `prompts_per_generation` groups are complete and no group
   still running would be too stale next round;
3. new groups keep `prompts_per_generation x (1 + rollout_overprovision) x num_generations`
   sequences running (at the start, and whenever a group's worth has finished), while fewer than
   `(max_staleness + 1) x prompts_per_generation` groups are ahead of the trainer;
4. the oldest complete groups train (then in the order they completed); the rest stay.

One driver, `run_round`, holds these rules for every rollout mode that supports partial rollouts; what the
members are and how they advance is the mode's (`RolloutMode.round_members`): plain completions
(`Completions` here, members `Member`) or an agent's trajectories (agents/rounds.py, members
`agents.loop.Trajectory`, which carry over mid-turn and between turns). `partial_round` is what the generate
stage calls: the stale groups dropped, the engine woken, one round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..bounds import FINITE_AT_LEAST_0, INTEGER_AT_LEAST_0
from ..options import mirror, option, options_record
from .batch import Rollouts
from .engines.base import Continuation, SamplingOptions, hashed_seed
from .truncation import KeptTokens


@options_record
@dataclass(frozen=True)
class RoundOptions:
    """What a round of partial rollouts reads (`prompts_per_generation`: the config's, given by the caller)."""

    max_staleness: int = option(
        0, "Partial rollouts (AReaL, verl's partial rollout): 0 samples each batch whole, waiting for its "
        "longest completion. k >= 1: generation runs in rounds that keep prompts_per_generation x (1 + "
        "rollout_overprovision) groups' worth of sequences running (new prompts join as sequences finish, "
        "while fewer than (k + 1) x prompts_per_generation groups are ahead of the trainer); a round ends "
        "once prompts_per_generation groups are complete and none still running would be more than k weight "
        "syncs stale next round; the oldest complete groups train, the unfinished completions continue under "
        "the next weights (tokens, sampling log-probs and policy versions kept; the IS correction defaults "
        "on). A group that still got too stale is dropped (rollout/dropped_stale). Larger k: a busier engine, "
        "staler tokens. vLLM engine, parallel rollouts, one process.",
        bounds=INTEGER_AT_LEAST_0)
    rollout_overprovision: float = option(
        0.5, "Partial rollouts: the sequences kept running in a round beyond prompts_per_generation x "
        "num_generations, as a share of it.",
        bounds=FINITE_AT_LEAST_0)
    num_generations: int = mirror(8)
    max_completion_length: int = mirror(64)
    prompts_per_generation: int = 8  # (GRPOConfig.prompts_per_generation: the batch's prompts)


@dataclass
class Member:
    """One completion of a group, as far as it has run."""

    ids: list = field(default_factory=list)  # its tokens so far
    logp: list = field(default_factory=list)  # the sampling log-prob of each
    ver: list = field(default_factory=list)  # the policy version that sampled each
    finish: Optional[str] = None  # None: still running; "stop" | "length"
    # truncated sampling, where the engine returns them: each token's kept set (KeptTokens); None: not returned
    kept: Optional[KeptTokens] = None

    def to_dict(self) -> dict:
        d = {"ids": list(self.ids), "logp": list(self.logp), "ver": list(self.ver), "finish": self.finish}
        return d if self.kept is None else {**d, "kept": self.kept.to_dict()}  # (the format before kept sets)

    @classmethod
    def from_dict(cls, d: dict) -> "Member":
        kept = KeptTokens.from_dict(d["kept"]) if d.get("kept") is not None else None
        return cls(list(d["ids"]), list(d["logp"]), list(d["ver"]), d["finish"], kept)

    def extended(self, c, version: int) -> "Member":
        """This member followed by an engine's Completion `c` (sampled at policy `version`)."""
        kept = None if c.kept is None else KeptTokens.cat(([self.kept] if self.kept is not None else []) + [c.kept])
        if kept is not None and len(kept) != len(self.ids) + len(c.token_ids):  # (an engine returning them mid-run)
            kept = None
        return Member(self.ids + c.token_ids, self.logp + c.logprobs, self.ver + [version] * len(c.token_ids),
                      c.finish_reason, kept)


@dataclass
class Group:
    """A prompt's group in flight: the prompt's index in the training data, the seed its members'
    sampling seeds derive from, its members."""

    prompt: int
    seed: int
    members: list  # [Member]
    # what the reward functions gave it, when it completed in a round that did not train it (memory only: a
    # resumed run scores it again, to the same values); the trainer's round reads it instead of scoring again
    scores: Optional[object] = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        """The checkpoint's form: plain dicts and lists (without `scores`)."""
        return {"prompt": self.prompt, "seed": self.seed, "members": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, d: dict) -> "Group":
        from .agents.loop import Trajectory  # (an agent's member: a trajectory, which has a mask)

        return cls(int(d["prompt"]), int(d["seed"]),
                   [Trajectory.from_dict(m) if "mask" in m else Member.from_dict(m) for m in d["members"]])


def new_groups(prompt_index: list[int], seeds: list[int], group_size: int,
               member: Callable[[int, int, int], object] = lambda prompt, seed, j: Member()) -> list[Group]:
    """Groups of `group_size` members not started (member(prompt, group seed, j): an agent's makes trajectories)."""
    return [Group(int(p), int(s), [member(int(p), int(s), j) for j in range(group_size)])
            for p, s in zip(prompt_index, seeds, strict=True)]


def round_limits(o: RoundOptions) -> tuple[int, int, int]:
    """(groups a round trains, sequences it keeps running, groups it lets be ahead of the trainer): the slot and
    admission rules of `run_round`."""
    wanted = o.prompts_per_generation
    return (wanted, math.ceil(wanted * (1 + o.rollout_overprovision)) * o.num_generations,
            (o.max_staleness + 1) * wanted)


def at_last_chance(pool: list[Group], version: int, max_staleness: int) -> list[Group]:
    """The groups that must complete in this round (their oldest token is max_staleness versions old now)."""
    return [g for g in pool if oldest_version(g) <= version - max_staleness]


def complete(group: Group) -> bool:
    return all(m.finish is not None for m in group.members)


def train_first(pool: list[Group], finished_at: dict, wanted: int) -> tuple[list[Group], list[Group]]:
    """(the `wanted` complete groups to train: the oldest first, then in the order they completed
    (finished_at: id(group) -> when its last member finished; absent: before the round), the rest)."""
    done = [k for k, g in enumerate(pool) if complete(g)]
    order = sorted(done, key=lambda k: (oldest_version(pool[k]), finished_at.get(id(pool[k]), -1), k))[:wanted]
    return [pool[k] for k in order], [g for k, g in enumerate(pool) if k not in order]


def staleness(trained: list[Group], version: int) -> dict:
    """The trained tokens' staleness (the model's tokens: an agent's tool results are not trained)."""
    stale = [version - v for g in trained for m in g.members
             for v, sampled in zip(m.ver, getattr(m, "mask", None) or [True] * len(m.ver), strict=True) if sampled]
    return {"rollout/staleness_mean": sum(stale) / max(len(stale), 1), "rollout/staleness_max": max(stale, default=0)}


def oldest_version(group: Group) -> float:
    return min((m.ver[0] for m in group.members if m.ver), default=math.inf)


def drop_stale(pool: list[Group], version: int, max_staleness: int) -> tuple[list[Group], int]:
    """(the groups that can still train at `version`, how many were dropped)."""
    kept = [g for g in pool if version - oldest_version(g) <= max_staleness]
    return kept, len(pool) - len(kept)


@dataclass
class Advanced:
    """What advancing a round's members did (a member kind's `advance`): the engine step at which each group
    completed (id(group) -> step; absent: complete before the round), and the round's figures."""

    finished_at: dict
    carried_over: int  # members continued from an earlier round
    busy_fraction: float  # requests running per engine step / the round's slots
    generated_tokens: int
    reprefill_tokens: int  # prefix tokens prefilled again (the continued members': the cache is gone after a sync)


def run_round(members, pool: list[Group], draw: Callable[[int], list[Group]], options: RoundOptions, *,
              version: int) -> tuple[list[Group], list[Group], dict]:
    """One round over `pool` (groups, modified in place; `draw(n)` gives n new groups) whose members advance as
    `members` (a member kind: `Completions`, or an agent's trajectories, agents/rounds.py) runs them:
    (the complete groups to train, the pool left for the next round, the round's rollout/ metrics).

    Three rules keep the engine busy without bias or waste (docs/design.md, "Partial rollouts"):
    - slots: the round keeps prompts_per_generation x (1 + rollout_overprovision) groups' worth of
      sequences running; new groups join at its start and whenever a group's worth has finished;
    - admission: at most (max_staleness + 1) x prompts_per_generation groups are ahead of the trainer
      (AReaL's bound: more could not all train within max_staleness versions);
    - the round ends once prompts_per_generation groups are complete and none still running would be
      too stale to train next round; the oldest complete groups train first. So long completions
      train too, where ending at the first complete groups would drop every long one as stale."""
    wanted, slots, ahead = round_limits(options)

    def top_up(busy: int) -> list[Group]:  # new groups for the free slots (busy: sequences running), within the bound
        n = min((slots - busy) // options.num_generations, ahead - len(pool))
        fresh = draw(n) if n > 0 else []
        pool.extend(fresh)
        return fresh

    last_chance = at_last_chance(pool, version, options.max_staleness)  # (a new group never is: it has no tokens)

    def enough(done: Callable[[Group], bool]) -> bool:  # enough complete groups, and none left to go too stale
        return sum(map(done, pool)) >= wanted and all(map(done, last_chance))

    moved = members.advance(pool, top_up, enough, version=version, slots=slots)
    trained, left = train_first(pool, moved.finished_at, wanted)
    stats = {"rollout/carried_over": moved.carried_over, **staleness(trained, version),
             "rollout/busy_fraction": moved.busy_fraction, "rollout/generated_tokens": moved.generated_tokens,
             "rollout/reprefill_tokens": moved.reprefill_tokens, "rollout/in_flight": len(pool)}
    return trained, left, stats


def partial_round(engine, members, in_flight: list[Group], draw_prompts: Callable[[int], tuple[list[int], list[int]]],
                  options: RoundOptions, *, version: int) -> tuple[Rollouts, list[Group], dict, list[Group]]:
    """A round of partial rollouts from the groups in flight: the too-stale ones dropped, the rest made ready
    (`members.prepare`), new groups from draw_prompts(n) (n prompt indices of the data order, a seed each).
    (the trained groups as Rollouts, the groups left in flight, the round's rollout/ metrics, the trained groups
    in the Rollouts' order.)"""
    pool, dropped = drop_stale(in_flight, version, options.max_staleness)
    ready = members.prepare(pool)

    def draw(n: int) -> list[Group]:
        prompts, seeds = draw_prompts(n)
        return new_groups(prompts, seeds, options.num_generations, members.new_member)

    trained, left, stats = run_round(members, pool, draw, options, version=version)
    return members.as_rollouts(trained), left, {**stats, "rollout/dropped_stale": dropped, **ready}, trained


class Completions:
    """Members that are plain completions (`Member`): each unfinished one runs as one request of the engine's
    request loop (`generate_until`), prompt + its tokens so far, its remaining budget, seeded by where it goes
    on. on_complete(group, its Rollouts): called at the engine step a group's last member finishes in the
    round (to score it while the round runs on; a group complete before the round is not handed over)."""

    def __init__(self, engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], *, sampling: SamplingOptions,
                 budget: int, on_complete: Optional[Callable[[Group, Rollouts], None]] = None):
        self.engine, self.tokenizer, self.prompt_ids, self.rows = engine, tokenizer, prompt_ids, rows
        self.sampling, self.budget, self.on_complete = sampling, budget, on_complete

    def prepare(self, pool: list[Group]) -> dict:
        """Nothing to make ready: a member read back from a checkpoint is its tokens."""
        return {}

    def new_member(self, prompt: int, seed: int, j: int) -> Member:
        return Member()

    def advance(self, pool: list[Group], top_up: Callable[[int], list[Group]],
                enough: Callable[[Callable[[Group], bool]], bool], *, version: int, slots: int) -> Advanced:
        """Run the pool's unfinished members (and top_up's new groups) until enough(complete) holds after an
        engine step; their tokens, log-probs and versions appended."""
        budget = self.budget
        running, requests, carried, members_left, slot = [], [], [], [], {}
        queued, done = {}, {}  # id(group) -> its requests (member, request index); request index -> Completion

        def join(groups: list[Group]) -> list[Continuation]:
            """Queue the unfinished members of `groups` (already in the pool or new) as requests."""
            new = []
            for g in groups:
                slot[id(g)] = len(members_left)
                members_left.append(sum(m.finish is None for m in g.members))
                for j, m in enumerate(g.members):
                    if m.finish is None:
                        queued.setdefault(id(g), []).append((j, len(running)))
                        running.append((g, j, m))
                        carried.append(bool(m.ids))  # continued from an earlier round
                        new.append(Continuation(self.prompt_ids[g.prompt] + m.ids, budget - len(m.ids),
                                                hashed_seed(g.seed, j, len(m.ids))))
            requests.extend(new)
            return new

        join(pool)
        join(top_up(len(requests)))

        def step_done(finished: list[bool]) -> bool:  # (the engine's: which requests have finished)
            left = list(members_left)
            for (g, _, _), ended in zip(running, finished, strict=True):
                left[slot[id(g)]] -= ended
            return enough(lambda g: left[slot[id(g)]] == 0)

        def more(finished: list[bool]) -> list[Continuation]:
            return join(top_up(finished.count(False)))

        def finished(k: int, c) -> None:  # (the engine's callback: request k ended at this step)
            done[k] = c
            g = running[k][0]
            if all(r in done for _, r in queued[id(g)]):
                ended = {j: done[r] for j, r in queued[id(g)]}
                members = [m.extended(ended[j], version) if j in ended else m for j, m in enumerate(g.members)]
                self.on_complete(g, self.as_rollouts([Group(g.prompt, g.seed, members)]))

        result = self.engine.generate_until(requests, step_done, more=more, sampling=self.sampling,
                                            on_finished=finished if self.on_complete is not None else None)
        last_step = {}  # id(group) -> the engine step at which its last member finished in this round
        for (g, j, m), c, step in zip(running, result.completions, result.finished_at, strict=True):
            m = g.members[j] = m.extended(c, version)
            if c.finish_reason is None and len(m.ids) >= budget:  # aborted on its last token
                m.finish = "length"
            if step is not None:
                last_step[id(g)] = max(last_step.get(id(g), -1), step)
        return Advanced(last_step, sum(carried), result.busy_fraction(slots),
                        sum(len(c.token_ids) for c in result.completions),
                        sum(len(r.prompt_ids) for r, c in zip(requests, carried, strict=True) if c))

    def as_rollouts(self, groups: list[Group]) -> Rollouts:
        """The groups' members as `Rollouts`, in order."""
        members = [(g.prompt, m) for g in groups for m in g.members]
        kept = [m.kept for _, m in members]
        return Rollouts(
            prompt_ids=[list(self.prompt_ids[p]) for p, _ in members],
            completion_ids=[list(m.ids) for _, m in members],
            sampling_logp=[torch.tensor(m.logp, dtype=torch.float32) for _, m in members],
            finish_reason=[m.finish for _, m in members],
            completion_texts=[self.tokenizer.decode(m.ids, skip_special_tokens=True) for _, m in members],
            rows=[self.rows[p] for p, _ in members],
            kept=kept if members and all(k is not None for k in kept) else None,
        )

"""Agents with partial rollouts (`max_staleness >= 1`): a trajectory carries over between rounds.

A round of generation/rounds.py's rules (its slots, its admission bound, its end: enough complete
groups and none at its last chance still running; the oldest complete groups train), whose members are
trajectories (loop.py), run by the loop's streaming driver: the engine never waits for a tool, a
trajectory's next turn joins the running batch as soon as its calls return. What differs from a
completion carried over:
- a trajectory stopped mid-turn keeps the turn's tokens so far (each with the version that sampled it); the
  next round continues the turn from there, seeded by where it goes on;
- a trajectory whose calls run when the round ends keeps them running: their results join it in the
  next round (once: the calls are the trajectory's, not the round's), and its next turn starts then.

A checkpoint holds the trajectories (`Trajectory.to_dict`): a resumed run runs the calls that were awaiting
results again (a deterministic tool gives the same results) and, for an environment, replays the recorded
calls on a fresh instance (`Agent.restore`); where the replayed results differ from the recorded ones, the
environment cannot be rebuilt and the trajectory starts again from its prompt (`rollout/restarted_trajectories`).
"""

from __future__ import annotations

from typing import Callable

from .. import rounds as partial_rollouts
from ..rounds import Group
from .loop import AgentLoop


def run_round(loop: AgentLoop, pool: list[Group], draw: Callable[[int], list[Group]], config, *,
              version: int) -> tuple[list[Group], list[Group], dict]:
    """One round over `pool` (groups of trajectories, modified in place; `draw(n)`: n new groups):
    (the complete groups to train, the pool left for the next round, the round's rollout/ metrics)."""
    wanted, slots, ahead = partial_rollouts.round_limits(config)
    loop.version = version
    group_of = {id(t): g for g in pool for t in g.members}
    finished_at: dict = {}  # id(group) -> the round's engine step at which it completed
    carried = [t for g in pool for t in g.members if not t.done and t.ids]
    # (after the weight sync a turn going on is prefilled again, prompt and all)
    reprefill = sum(len(t.running_ids) for t in carried if t.awaiting is None)

    def top_up(busy: int) -> list:  # new groups for the free slots, within the admission bound
        n = min((slots - busy) // config.num_generations, ahead - len(pool))
        fresh = draw(n) if n > 0 else []
        pool.extend(fresh)
        group_of.update({id(t): g for g in fresh for t in g.members})
        return [t for g in fresh for t in g.members]

    last_chance = partial_rollouts.at_last_chance(pool, version, config.max_staleness)

    def enough() -> bool:
        return sum(map(partial_rollouts.complete, pool)) >= wanted and all(map(partial_rollouts.complete, last_chance))

    def on_done(t, step: int) -> None:
        if partial_rollouts.complete(group_of[id(t)]):
            finished_at[id(group_of[id(t)])] = step

    counts = loop.stream([t for g in pool for t in g.members], enough, top_up, on_done)
    trained, left = partial_rollouts.train_first(pool, finished_at, wanted)
    stats = {"rollout/carried_over": len(carried), **partial_rollouts.staleness(trained, version),
             "rollout/busy_fraction": counts["busy"] / (counts["steps"] * slots) if counts["steps"] else 1.0,
             "rollout/generated_tokens": counts["generated"], "rollout/reprefill_tokens": reprefill,
             "rollout/in_flight": len(pool)}
    return trained, left, stats

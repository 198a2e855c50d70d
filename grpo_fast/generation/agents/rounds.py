"""Agents with partial rollouts (`max_staleness >= 1`): a trajectory carries over between rounds.

The members of generation/rounds.py's rounds (its rules: slots, the admission bound, the end: enough complete
groups and none at its last chance still running; the oldest complete groups train) when they are
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

from ..engines.base import hashed_seed
from ..rounds import Advanced, Group, complete


class Trajectories:
    """The member kind of an agent's rounds (`rounds.run_round`): each member a `loop.Trajectory` of `agent`,
    run by one `AgentLoop` (the engine, the tokenizer, `sampling`, `max_completion_length`)."""

    def __init__(self, agent, engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], *, sampling,
                 max_completion_length: int):
        self.agent, self.tokenizer, self.prompt_ids, self.rows = agent, tokenizer, prompt_ids, rows
        self.loop = agent.loop(engine, tokenizer, sampling=sampling, max_completion_length=max_completion_length)

    def prepare(self, pool: list[Group]) -> dict:
        """The groups in flight made whole: the environments of trained or dropped groups free again, a trajectory
        read back from a checkpoint given its environment back (`Agent.restore`)."""
        agent = self.agent
        if agent.environments is not None:
            agent.environments.release_all_but([t.environment for g in pool for t in g.members])
        restarted = sum(not agent.restore(t, self.rows[g.prompt], self.loop) for g in pool for t in g.members)
        return {"rollout/restarted_trajectories": restarted}

    def new_member(self, prompt: int, seed: int, j: int):
        """Trajectory j of a new group (its seed hashed from the group's)."""
        return self.agent.trajectory(self.prompt_ids[prompt], self.rows[prompt], hashed_seed(seed, j))

    def advance(self, pool: list[Group], top_up: Callable[[int], list[Group]],
                enough: Callable[[Callable[[Group], bool]], bool], *, version: int, slots: int) -> Advanced:
        """Run the pool's live trajectories (and top_up's new groups') turns and tools until enough(complete)."""
        loop = self.loop
        loop.version = version
        group_of = {id(t): g for g in pool for t in g.members}
        finished_at: dict = {}  # id(group) -> the round's engine step at which it completed
        carried = [t for g in pool for t in g.members if not t.done and t.ids]
        # (after the weight sync a turn going on is prefilled again, prompt and all)
        reprefill = sum(len(t.running_ids) for t in carried if t.awaiting is None)

        def more(busy: int) -> list:
            fresh = top_up(busy)
            group_of.update({id(t): g for g in fresh for t in g.members})
            return [t for g in fresh for t in g.members]

        def on_done(t, step: int) -> None:
            if complete(group_of[id(t)]):
                finished_at[id(group_of[id(t)])] = step

        counts = loop.stream([t for g in pool for t in g.members], lambda: enough(complete), more, on_done)
        return Advanced(finished_at, len(carried),
                        counts["busy"] / (counts["steps"] * slots) if counts["steps"] else 1.0,
                        counts["generated"], reprefill)

    def as_rollouts(self, groups: list[Group]):
        """The groups' trajectories as `Rollouts` (`Agent.as_rollouts`: the tool counters in its stats)."""
        return self.agent.as_rollouts([t for g in groups for t in g.members],
                                      [self.rows[g.prompt] for g in groups for _ in g.members], self.tokenizer,
                                      self.loop.waiting_seconds)

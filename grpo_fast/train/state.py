"""The loop's state: everything of a run that changes while it trains, in one dataclass, saved in
every checkpoint (`checkpoint.py`: trainer_state.pt["state"]) and restored by `resume.restore`.
Its fields are a checkpoint format: add fields with defaults, never rename or drop one."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from ..generation.rounds import Group


@dataclass
class TrainState:
    """Everything of the loop that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # passes over the training prompts started
    cursor: int = 0  # next position in this epoch's prompt order
    generation_calls: int = 0  # engine calls made (each gets seed + this, for reproducible sampling)
    skipped_steps: int = 0  # steps dropped for a non-finite loss or gradient
    signal_free_steps: int = 0  # steps in a row with no finite reward or a skipped update
    eval_history: list = field(default_factory=list)  # (step, accuracy)
    eval_reward_history: list = field(default_factory=list)  # (step, held-out mean of the first reward)
    eval_metric_history: dict = field(default_factory=dict)  # name -> [(step, value)] of the eval_metrics
    entropy_coef: Optional[float] = None  # the entropy bonus's coefficient now (adaptive: it moves); None: config's
    last_entropy: float = math.inf  # the bonus tokens' entropy at the last optimizer step (adaptive gate)
    global_batch: int = 0  # completions per optimizer step over all ranks (a resumed run must keep it)
    policy_version: int = 0  # weight syncs into the engine so far (partial rollouts: the version of each token)
    in_flight: list = field(default_factory=list)  # partial rollouts: the `Group`s carried over (generation/rounds.py)
    tracker_runs: dict = field(default_factory=dict)  # report_to: tracker -> its run's id, continued on resume

    def to_dict(self) -> dict:
        """The checkpoint's form (plain dicts and lists; a group in flight as `Group.to_dict` writes it)."""
        return {**asdict(replace(self, in_flight=[])), "in_flight": [g.to_dict() for g in self.in_flight]}

    @classmethod
    def from_dict(cls, saved: dict) -> "TrainState":
        """A checkpoint's state, of this version or an earlier one (fields added since take their defaults)."""
        state = cls(**saved)
        return replace(state, in_flight=[Group.from_dict(g) for g in state.in_flight])

"""From scored rollouts to advantages, with the GRPO variants' reward shaping (the math is in
`objective.py`; each rollout mode applies it to a generation batch: its `advantages`, in
`grpo_fast.generation.modes`, one file each). This stage asks the batch's mode, with the options it reads
(`AdvantageOptions`) and the partial-credit judge as a scorer.

"Correct" is the first reward function's value > 0 (the verifier's; missing counts as wrong: `objective.correct`).

    rollout_mode=parallel      group advantages of the (weighted) rewards, after SGPO's partial
                               credit (groups with no correct answer: the first reward becomes
                               sigmoid(beta (judge score - gamma))); then GRPO-LEAD's difficulty
                               weights and Stable GRPO's noise-aware weights multiply them
    rollout_mode=early_exit    S-GRPO: the first reward becomes the decaying serial reward of each
                               serial group (1/2^(i-1) for its i-th correct member, else 0), the
                               other functions' rewards are added with their weights as in
                               parallel mode; advantage r - mean(r) of that weighted sum
    rollout_mode=multi_answer  GRPO-MA: answers get the group advantage over their prompt's K x M
                               answers, thoughts the advantage of their mean answer reward over the
                               prompt's K thoughts (rewards: the weighted sum of every function's)

Every mode leaves the rewards its advantages came from in `batch.trained_rewards` (n, k): the
logged `reward` is their weighted sum, so what is logged is what trained. What a mode cannot
honour is refused by name before any work (`config_checks.COMBINATIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..bounds import FINITE, FINITE_AT_LEAST_0, Bounds
from ..distributed import ONE_PROCESS, World
from ..generation.batch import Rollouts
from ..generation.modes import rollout_mode
from ..objective import REWARD_AGGREGATIONS, SCALE_REWARDS, STD_ESTIMATORS, correct  # noqa: F401 (correct: evaluate's)
from ..options import mirror, option, options_record, read_config
from .score import score


@options_record
@dataclass(frozen=True)
class AdvantageOptions:
    """What the advantages stage reads of the config, built once (`from_config`): the options it declares, the
    ones it reads (`mirror`: declared with the sampling and the rollout modes) and the group size."""

    rollout_mode: str = mirror("parallel")
    num_generations: int = mirror(8)
    group_size: int = 8  # trained sequences per prompt (multi_answer: K thoughts and K x M answers)
    scale_rewards: str = option("group", "Advantage scaling: divide by the group std, the batch std, or not at all (Dr. GRPO).", SCALE_REWARDS)
    advantage_std: str = option("population", "Std estimator for the advantages: population (biased) or sample (unbiased, as TRL).", STD_ESTIMATORS)
    reward_weights: Optional[tuple] = None  # the config's, as a tuple
    multi_objective_aggregation: str = option("sum_then_normalize", "With several rewards: weight-sum then normalise (TRL), or normalise each then sum.", REWARD_AGGREGATIONS)
    difficulty_weighting: bool = option(False, "GRPO-LEAD's difficulty-aware advantages: with rho the group's share of correct answers and w(x) = difficulty_A + (difficulty_B - difficulty_A) / (1 + exp(difficulty_k (x - difficulty_rho0))), positive advantages are multiplied by w(rho), the others by w(1 - rho): hard prompts' successes and easy prompts' failures weigh more.")
    difficulty_A: float = option(0.4, "difficulty_weighting: the smallest weight A.", bounds=FINITE_AT_LEAST_0)
    difficulty_B: float = option(1.5, "difficulty_weighting: the largest weight B.", bounds=FINITE_AT_LEAST_0)
    difficulty_rho0: float = option(0.75, "difficulty_weighting: the share of correct answers at the weight's midpoint.", bounds=FINITE)
    difficulty_k: float = option(10.0, "difficulty_weighting: the steepness k.", bounds=FINITE)
    reward_noise_rate: Optional[float] = option(None, "Stable GRPO's noise-aware advantages for a verifier that flips rewards at this rate p in [0, 0.5): each group's advantages are multiplied by w*(mean reward, p), 0 for groups whose mean is within the noise. Reads the first reward function's values, which must lie in [0, 1]. None: off.", bounds=Bounds(low=0, high=0.5, high_open=True, text="a flip rate in [0, 0.5)"))
    partial_credit_judge: Optional[str] = option(None, "SGPO partial credit: a judge (a built-in reward name such as chain_steps, or module:function with TRL's reward signature) scoring each completion's reasoning in [0, 1]; in a group with no correct answer, each first-reward value becomes sigmoid(partial_credit_beta (score - partial_credit_gamma)). None: off.")
    partial_credit_beta: float = option(5.0, "partial credit: the sigmoid's slope beta.", bounds=FINITE_AT_LEAST_0)
    partial_credit_gamma: float = option(0.5, "partial credit: the judge score at which the credit is 0.5.", bounds=FINITE)
    early_exit_points: int = mirror(7)
    answers_per_thought: int = mirror(4)

    @classmethod
    def from_config(cls, config) -> "AdvantageOptions":
        weights = None if config.reward_weights is None else tuple(config.reward_weights)
        return read_config(cls, config, reward_weights=weights, group_size=config.group_size)


def advantages(batch: Rollouts, c: AdvantageOptions, judge: Optional[Callable] = None, *, prompt_column: str = "prompt",
               conversational: bool = False, world: World = ONE_PROCESS) -> tuple[torch.Tensor, dict]:
    """(advantages [n] float32, stats) of a scored batch, as its rollout mode computes them
    (`grpo_fast.generation.modes`); `judge` is the partial-credit judge, a reward function the mode has score
    the completions it asks about (prompts from `prompt_column`, `conversational` ones as messages). Under
    torchrun, `batch` is this rank's share of the generation batch (whole groups, the same size on every rank).
    Sets `batch.trained_rewards`: the scored rewards as the mode reshaped them (module docstring)."""
    judged = None if judge is None else (lambda part: score([judge], part, prompt_column, conversational).rewards)
    return rollout_mode(c.rollout_mode).advantages(batch, c, judged, world=world)

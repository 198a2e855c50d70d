"""From scored rollouts to advantages, with the GRPO variants' reward shaping (the math is in
`objective.py`; this applies it to a generation batch as `GRPOConfig` asks).

"Correct" is the first reward function's value > 0 (the verifier's; missing counts as wrong).

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

from .. import objective
from .batch import Rollouts
from .distributed import ONE_PROCESS, World, gather_rows
from .score import score, weighted_rewards


@dataclass(frozen=True)
class AdvantageOptions:
    """What the advantages stage reads of the config, built once (`from_config`)."""

    rollout_mode: str = "parallel"
    num_generations: int = 8
    group_size: int = 8  # trained sequences per prompt (multi_answer: K thoughts and K x M answers)
    scale_rewards: str = "group"
    advantage_std: str = "population"
    reward_weights: Optional[tuple] = None
    multi_objective_aggregation: str = "sum_then_normalize"
    difficulty_weighting: bool = False
    difficulty_A: float = 0.4
    difficulty_B: float = 1.5
    difficulty_rho0: float = 0.75
    difficulty_k: float = 10.0
    reward_noise_rate: Optional[float] = None
    partial_credit_judge: Optional[str] = None
    partial_credit_beta: float = 5.0
    partial_credit_gamma: float = 0.5
    early_exit_points: int = 7
    answers_per_thought: int = 4

    @classmethod
    def from_config(cls, config) -> "AdvantageOptions":
        names = [f for f in cls.__dataclass_fields__ if f not in ("reward_weights", "group_size")]
        weights = None if config.reward_weights is None else tuple(config.reward_weights)
        return cls(**{n: getattr(config, n) for n in names}, reward_weights=weights, group_size=config.group_size)


def correct(rewards: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the first reward function's value > 0."""
    return torch.nan_to_num(rewards[:, 0], nan=0.0) > 0


def advantages(batch: Rollouts, c: AdvantageOptions, judge: Optional[Callable] = None, *, prompt_column: str = "prompt",
               conversational: bool = False, world: World = ONE_PROCESS) -> tuple[torch.Tensor, dict]:
    """(advantages [n] float32, stats) of a scored batch; `judge` is the partial-credit judge. Under
    torchrun, `batch` is this rank's share of the generation batch (whole groups, the same size on
    every rank): statistics over the whole batch (`scale_rewards="batch"`) use every rank's rewards.
    Sets `batch.trained_rewards`: the scored rewards as the mode reshaped them (module docstring)."""
    if c.rollout_mode == "early_exit":
        return _serial_advantages(batch, c)
    if c.rollout_mode == "multi_answer":
        return _thought_answer_advantages(batch, c)
    G, rewards, stats = c.num_generations, batch.rewards, {}
    ok = correct(rewards)
    if judge is not None:
        rewards, stats = _partial_credit(batch, ok, c, judge, prompt_column, conversational)
    batch.trained_rewards = rewards
    mine = slice(None)
    if c.scale_rewards == "batch" and world.size > 1:  # the std over all ranks' rewards, as one process has it
        mine = slice(world.rank * len(rewards), (world.rank + 1) * len(rewards))
        rewards = gather_rows(rewards, world)
    adv = objective.group_advantages(rewards, G, scale_rewards=c.scale_rewards, std=c.advantage_std,
                                     reward_weights=c.reward_weights, aggregation=c.multi_objective_aggregation)[mine]
    rewards = rewards[mine]
    if c.difficulty_weighting:
        adv = objective.difficulty_weights(adv, ok, G, A=c.difficulty_A, B=c.difficulty_B, rho0=c.difficulty_rho0,
                                           k=c.difficulty_k)
    if c.reward_noise_rate is not None:
        first = torch.nan_to_num(rewards[:, 0], nan=0.0)
        if bool(((first < 0) | (first > 1)).any()):
            raise ValueError(f"reward_noise_rate={c.reward_noise_rate} needs the first reward function's values in "
                             f"[0, 1] (a verifier's 0/1), got values in [{float(first.min())}, {float(first.max())}]")
        weights = objective.noise_aware_weights(first, G, p=c.reward_noise_rate)
        adv = adv * weights
        stats["noise_aware/weight_mean"] = weights.mean().item()
    return adv, stats


def _partial_credit(batch: Rollouts, ok: torch.Tensor, c: AdvantageOptions, judge, prompt_column: str, conversational: bool):
    """The rewards with SGPO's partial credit in the groups that have no correct answer: the judge
    runs on those completions only."""
    G = c.num_generations
    none_right = ~ok.view(-1, G).any(1)
    rows = [g * G + j for g in range(len(none_right)) if none_right[g] for j in range(G)]
    rewards = batch.rewards.clone()
    if rows:
        scores, _ = score([judge], batch.select(rows), prompt_column, conversational)
        judged = torch.nan_to_num(scores[:, 0], nan=0.0)  # None (no reasoning to judge): no credit
        if bool(((judged < 0) | (judged > 1)).any()):
            raise ValueError(f"partial_credit_judge={c.partial_credit_judge!r}: expected scores in [0, 1], got values "
                             f"in [{float(judged.min())}, {float(judged.max())}]")
        step_scores = torch.full((len(batch),), 0.0, dtype=torch.float64)
        step_scores[rows] = judged
        credit = objective.partial_credit_rewards(rewards[:, 0].nan_to_num(0.0), ok, step_scores, G,
                                                  beta=c.partial_credit_beta, gamma=c.partial_credit_gamma)
        rewards[rows, 0] = credit[rows].double()
    return rewards, {"partial_credit/frac_groups": none_right.float().mean().item()}


def _serial_advantages(batch: Rollouts, c: AdvantageOptions) -> tuple[torch.Tensor, dict]:
    G = c.num_generations
    ok = correct(batch.rewards).view(-1, G)
    serial = torch.stack([objective.decaying_serial_rewards(group) for group in ok])  # (P, m + 1)
    rewards = batch.rewards.clone()
    rewards[:, 0] = serial.reshape(-1).double()  # the verifier's value becomes the serial reward
    batch.trained_rewards = rewards
    total = weighted_rewards(rewards, c.reward_weights).view(-1, G)  # (P, m + 1); never NaN: column 0 is known
    adv = total - total.mean(1, keepdim=True)
    first = [int(group.nonzero()[0]) if group.any() else None for group in ok]  # exit index of the first right one
    found = [f for f in first if f is not None]
    bodies = [len(ids) - (reason == "stop") for ids, reason, kind in
              zip(batch.completion_ids, batch.finish_reason, batch.kind or ["full"] * len(batch), strict=True)
              if kind == "full"]
    stats = {"early_exit/serial_reward_mean": serial.mean().item(),
             "early_exit/first_correct_exit": sum(found) / len(found) if found else float("nan"),
             # full completions shorter than early_exit_points: some of their cuts coincide (rollout_modes.py)
             "early_exit/short_completion_frac": sum(b < c.early_exit_points for b in bodies) / max(len(bodies), 1)}
    return adv.reshape(-1).float(), stats


def _thought_answer_advantages(batch: Rollouts, c: AdvantageOptions) -> tuple[torch.Tensor, dict]:
    K, M = c.num_generations, c.answers_per_thought
    batch.trained_rewards = batch.rewards
    total = torch.nan_to_num(weighted_rewards(batch.rewards, c.reward_weights), nan=0.0).view(-1, K * (1 + M))
    thought, answer = objective.thought_answer_advantages(total[:, K:].reshape(-1, K, M))
    adv = torch.cat([thought, answer.flatten(1)], dim=1)
    return adv.reshape(-1).float(), {"multi_answer/thought_advantage_abs_mean": thought.abs().mean().item()}

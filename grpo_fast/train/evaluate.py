"""Held-out evaluation: greedy completions of the eval prompts, graded by the reward functions (and
the task's own metrics), and the histories a checkpoint keeps of them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import distributed
from ..bounds import INTEGER_AT_LEAST_0, INTEGER_AT_LEAST_1
from ..data.inputs import InputOptions, encode
from ..generation.batch import from_engine
from ..generation.engines.base import GREEDY
from ..options import mirror, option, options_record
from ..rewards.names import reward_name
from .advantages import correct
from .score import conversational, score, weighted_mean


@dataclass(frozen=True)
class HeldOut:
    """The held-out prompts (None: no evaluation during training) and the task's metrics besides the rewards."""

    rows: Optional[list] = None
    metrics: dict = field(default_factory=dict)  # name -> function with the reward signature


@options_record
@dataclass(frozen=True)
class EvalOptions:
    """When the loop evaluates (eval_steps, eval_before_train) and what `evaluate` reads: how many held-out prompts,
    their completion budget, and how they are graded."""

    eval_steps: int = option(5, "Evaluate every this many steps, and after the last (0: only before and after training).", bounds=INTEGER_AT_LEAST_0)
    eval_before_train: bool = option(True, "Evaluate once before the first step (the baseline).")
    eval_max_samples: int = option(200, "Held-out prompts used by evaluate() (greedy decoding, one completion each).", bounds=INTEGER_AT_LEAST_1)
    eval_max_completion_length: Optional[int] = option(None, "Most tokens per eval completion. None: max_completion_length.", bounds=INTEGER_AT_LEAST_1)
    prompt_column: str = mirror("prompt")
    max_completion_length: int = mirror(64)
    reward_timeout: Optional[float] = mirror(None)
    reward_weights: Optional[list] = mirror(None)


@torch.no_grad()
def evaluate(engine, tokenizer, rows: list, reward_funcs: list, eval_metrics: dict, options: EvalOptions,
             inputs: InputOptions, world, engine_weights=contextlib.nullcontext, agent=None) -> dict:
    """Greedy completions for the held-out prompts (one each, whatever the rollout mode); accuracy =
    the share of correct answers: the first reward function's value > 0, whatever the shaping.
    Returns eval/accuracy, eval/reward, eval/rewards/<func>/mean, lengths (all, and of the right ones).
    Under torchrun every rank calls it: each grades every world-size-th prompt, the scores are gathered.
    rows: the held-out rows (the first eval_max_samples of them are graded). agent (multi_turn): each
    prompt answered as one greedy trajectory, with the tools. inputs: how the prompts are encoded (the run's)."""
    c = options
    rows = (rows or [])[: c.eval_max_samples]
    if not rows:
        raise ValueError("evaluate() needs eval rows: pass eval_dataset to GRPOTrainer or rows= to evaluate()")
    chat = conversational(rows[0][c.prompt_column])
    mine = rows[world.rank :: world.size]  # under torchrun each rank grades its share
    rewards = torch.empty(0, len(reward_funcs), dtype=torch.float64)
    lengths, extra = torch.empty(0), torch.empty(0, len(eval_metrics), dtype=torch.float64)
    prompt_ids = encode(mine, tokenizer, inputs, agent) if mine else []
    budget = c.eval_max_completion_length or c.max_completion_length
    with engine_weights():  # (every rank enters, its share empty or not: under FSDP2 gathering is collective)
        if not mine:
            batch = None
        elif agent is not None:
            batch = agent.rollouts(engine, tokenizer, prompt_ids, mine, [0] * len(mine), 1, sampling=GREEDY,
                                   max_completion_length=budget)
        else:
            batch = from_engine(engine.generate(prompt_ids, n=1, sampling=GREEDY, max_new_tokens=budget),
                                prompt_ids, mine)
    if mine:
        rewards = score(reward_funcs, batch, c.prompt_column, chat, timeout=c.reward_timeout).rewards
        lengths = batch.model_lengths()
        if eval_metrics:  # the task's own grading (e.g. only answers in the instructed \boxed{})
            extra = score(list(eval_metrics.values()), batch, c.prompt_column, chat).rewards
    rewards, lengths, extra = (distributed.gather_rows(t, world) for t in (rewards, lengths, extra))
    right = correct(rewards)
    out = {"eval/accuracy": right.float().mean().item(), "eval/reward": weighted_mean(rewards, c.reward_weights),
           "eval/completions/mean_length": lengths.mean().item(),
           "eval/completions/mean_length_correct": lengths[right].mean().item() if right.any() else float("nan")}
    for j, f in enumerate(reward_funcs):
        out[f"eval/rewards/{reward_name(f)}/mean"] = _nanmean(rewards[:, j])
    for name, column in zip(eval_metrics, extra.T, strict=True):
        out[f"eval/{name}"] = torch.nan_to_num(column, nan=0.0).mean().item()
    if agent is not None:  # (every rank: the counters are summed over the ranks)
        from ..generation.agents import TOOL_COUNTERS, tool_metrics

        stats = batch.stats if batch is not None else dict.fromkeys(TOOL_COUNTERS, 0)
        out.update({f"eval/{k}": v for k, v in tool_metrics(stats, world).items() if k != "tools/time_waiting"})
    return out


def record(state, metrics: dict, reward_funcs: list, eval_metrics: dict, prompts: int) -> str:
    """Append an evaluation to the state's histories (kept in checkpoints); the line to print."""
    state.eval_history.append((state.step, metrics["eval/accuracy"]))
    first = f"eval/rewards/{reward_name(reward_funcs[0])}/mean"
    state.eval_reward_history.append((state.step, metrics[first]))
    for name in eval_metrics:
        state.eval_metric_history.setdefault(name, []).append((state.step, metrics[f"eval/{name}"]))
    extra = "".join(f", {name} {metrics[f'eval/{name}']:.3f}" for name in eval_metrics)
    return (f"step {state.step}: held-out accuracy {metrics['eval/accuracy']:.3f}{extra} "
            f"({prompts} prompts, greedy, {metrics['time/eval']:.0f}s)")


def _nanmean(x: torch.Tensor) -> float:
    known = x[~x.isnan()]
    return known.mean().item() if known.numel() else float("nan")

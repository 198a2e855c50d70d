"""S-GRPO's serial groups (rollout_mode=early_exit).

Sampling, per prompt: one full completion; m = early_exit_points cut positions spread over its tokens (one
drawn uniformly in each of m equal spans, seeded; distinct unless the completion is shorter than m, which is
warned about); each cut continues from prompt + prefix + `early_exit_text` for at most
`early_exit_answer_length` tokens (prompt + prefix is a longer prompt through the one engine interface, so both
engines run it; vLLM's prefix cache makes the shared part cheap). The serial group, in exit order, is the m
cuts (shortest first), then the full completion. A cut trains on prefix + injected text + answer with the
injected text masked (`loss_mask`, NaN sampling log-probs), and is graded on its answer alone.

Advantages: the first reward becomes the decaying serial reward of each serial group (1/2^(i-1) for its
i-th correct member, else 0), the other functions' rewards are added with their weights; advantage
r - mean(r) of that weighted sum.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Callable

from ...bounds import INTEGER_AT_LEAST_1
from ...options import OUTSIDE_01, Combination, first_reward, mirror, option, options_record
from ..engines.base import SamplingOptions, prompt_seeds
from . import RolloutMode, register

logger = logging.getLogger(__name__)
_warned = {"short": False}


@options_record
@dataclass(frozen=True)
class EarlyExitOptions:
    """What early_exit's sampling reads."""

    max_completion_length: int = mirror(64)
    early_exit_points: int = option(7, "early_exit: cut positions per full completion (m), spread over its tokens "
                                    "(one drawn at random in each of m equal spans, seeded).", bounds=INTEGER_AT_LEAST_1)
    early_exit_text: str = option("\nTime is limited, stop thinking and start answering. The final answer is",
                                  "early_exit: text injected after each cut; the member is graded on what follows "
                                  "it, and the injected tokens are masked out of the loss.")
    early_exit_answer_length: int = option(16, "early_exit: most tokens of the answer generated after "
                                           "early_exit_text.", bounds=INTEGER_AT_LEAST_1)


class EarlyExit(RolloutMode):
    name = "early_exit"
    summary = "S-GRPO: serial groups of early exits from one full completion per prompt"
    options = EarlyExitOptions

    def max_sequence_completion(self, c) -> int:
        # a prefix, the injected text (bounded by its UTF-8 bytes) and the answer
        return c.max_completion_length + len(c.early_exit_text.encode()) + c.early_exit_answer_length

    def checks(self) -> tuple:
        return (
            Combination("num_generations", None, lambda c: (
                f"early_exit_points + 1 = {c.early_exit_points + 1} with rollout_mode='early_exit' (a serial group is "
                f"the early_exit_points cuts plus the full completion); set num_generations or early_exit_points to "
                f"match"),
                lambda c: c.num_generations != c.early_exit_points + 1, ""),
            Combination("early_exit_points", None, lambda c: (
                f"at most max_completion_length ({c.max_completion_length}) with rollout_mode='early_exit': a "
                f"completion of L tokens has at most L distinct cut positions, so more cuts would coincide"),
                lambda c: c.early_exit_points > c.max_completion_length, ""),
            Combination("reward_funcs", None, lambda c: (
                f"a 0/1 verifier first with rollout_mode='early_exit', not {first_reward(c)!r}: the serial reward "
                f"replaces the first function's value (its correctness is all it keeps), so {first_reward(c)!r}'s "
                f"length term would never train; S-GRPO's decay is the length term (put 'math' first, "
                f"{first_reward(c)!r} after it to add it with its weight)"),
                lambda c: first_reward(c) in OUTSIDE_01, ""),
        )

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed):
        return serial_groups(engine, tokenizer, prompts, rows, c, seed, sampling=sampling)

    def advantages(self, batch, c, judge=None, *, world=None):
        import torch

        from ... import objective

        G = c.num_generations
        ok = objective.correct(batch.rewards).view(-1, G)
        serial = torch.stack([objective.decaying_serial_rewards(group) for group in ok])  # (P, m + 1)
        rewards = batch.rewards.clone()
        rewards[:, 0] = serial.reshape(-1).double()  # the verifier's value becomes the serial reward
        batch.trained_rewards = rewards
        total = objective.weighted_rewards(rewards, c.reward_weights).view(-1, G)  # (P, m + 1); never NaN: column 0 is known
        adv = total - total.mean(1, keepdim=True)
        first = [int(group.nonzero()[0]) if group.any() else None for group in ok]  # exit index of the first right one
        found = [f for f in first if f is not None]
        bodies = [len(ids) - (reason == "stop") for ids, reason, kind in
                  zip(batch.completion_ids, batch.finish_reason, batch.kind or ["full"] * len(batch), strict=True)
                  if kind == "full"]
        stats = {"early_exit/serial_reward_mean": serial.mean().item(),
                 "early_exit/first_correct_exit": sum(found) / len(found) if found else float("nan"),
                 # full completions shorter than early_exit_points: some of their cuts coincide (serial_groups)
                 "early_exit/short_completion_frac": sum(b < c.early_exit_points for b in bodies) / max(len(bodies), 1)}
        return adv.reshape(-1).float(), stats


def cut_positions(length: int, m: int, rng: random.Random) -> list[int]:
    """m prefix lengths in [0, length), non-decreasing: one drawn uniformly in each of m equal spans
    (span i holds the positions in [i length / m, (i + 1) length / m)). With length >= m every span
    holds a position and the cuts are distinct; a shorter length has fewer positions than cuts, so
    some coincide (`serial_groups` warns)."""
    if length < m:
        return [min(int((i + rng.random()) * length / m), max(length - 1, 0)) for i in range(m)]
    bounds = [-(-i * length // m) for i in range(m + 1)]  # ceil(i length / m): span i is [bounds[i], bounds[i + 1])
    return [lo + int(rng.random() * (hi - lo)) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def serial_groups(engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], c, next_seed: Callable[[], int], *,
                  sampling: SamplingOptions):
    """S-GRPO's serial groups as `Rollouts`: `len(prompt_ids) * (early_exit_points + 1)` entries (module docstring;
    c: EarlyExitOptions)."""
    from ..batch import Entries

    m = c.early_exit_points
    seeds = prompt_seeds(next_seed(), len(prompt_ids))
    full = [g[0] for g in engine.generate(prompt_ids, n=1, max_new_tokens=c.max_completion_length, seed=seeds,
                                          sampling=sampling)]
    injected = tokenizer.encode(c.early_exit_text, add_special_tokens=False)
    cuts, short = [], []
    for completion, seed in zip(full, seeds, strict=True):  # the cuts fall in the reasoning: not on an ending EOS
        body = len(completion.token_ids) - (completion.finish_reason == "stop")
        cuts.append(cut_positions(body, m, random.Random(seed)))
        if body < m:
            short.append(body)
    if short and not _warned["short"]:  # once a process; `early_exit/short_completion_frac` counts them every step
        _warned["short"] = True
        logger.warning("early_exit_points=%d is more than the reasoning length of %d of %d full completions (shortest "
                       "%d tokens): their cuts coincide, so a serial group answers the same prefix more than once. "
                       "Lower early_exit_points (the metric early_exit/short_completion_frac counts such completions)",
                       m, len(short), len(full), min(short))
    requests = [p + full[i].token_ids[:k] + injected for i, p in enumerate(prompt_ids) for k in cuts[i]]
    answers = [g[0] for g in engine.generate(requests, n=1, max_new_tokens=c.early_exit_answer_length,
                                             seed=prompt_seeds(next_seed(), len(requests)), sampling=sampling)]
    out = Entries()
    for i, (prompt, row, completion) in enumerate(zip(prompt_ids, rows, full, strict=True)):
        for j, k in enumerate(cuts[i]):
            answer = answers[i * m + j]
            out.add(prompt, row, completion.token_ids[:k] + injected + answer.token_ids,
                    completion.logprobs[:k] + [math.nan] * len(injected) + answer.logprobs,
                    [True] * k + [False] * len(injected) + [True] * len(answer.token_ids),
                    answer.finish_reason, answer.text, "cut")
        out.add(prompt, row, completion.token_ids, completion.logprobs, [True] * len(completion.token_ids),
                completion.finish_reason, completion.text, "full")
    return out.rollouts()


register(EarlyExit())

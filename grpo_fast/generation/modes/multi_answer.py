"""GRPO-MA's thoughts and answers (rollout_mode=multi_answer).

Sampling, per prompt: K = num_generations thoughts, each ended at the first `thought_end` (kept) or at
`max_thought_length` tokens (an ending EOS is dropped: the answers continue the thought); then
M = answers_per_thought answers sampled from prompt + thought (a longer prompt through the one engine
interface, so both engines run it). The entries are the K thoughts, then thought 1's M answers, thought 2's,
...; a thought trains as its own sequence, an answer as thought + answer with the thought masked
(`loss_mask`, NaN sampling log-probs), graded on the whole text.

Advantages: answers get the group advantage over their prompt's K x M answers, thoughts the advantage of
their mean answer reward over the prompt's K thoughts (rewards: the weighted sum of every function's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from ...bounds import INTEGER_AT_LEAST_1
from ...options import mirror, option, options_record
from ..engines.base import SamplingOptions, prompt_seeds
from . import RolloutMode, register


@options_record
@dataclass(frozen=True)
class MultiAnswerOptions:
    """What multi_answer's sampling reads. thought_end as its builder resolved it (the generate stage: None in the
    config is the built-in task's own, data/inputs.thought_end)."""

    num_generations: int = mirror(8)
    max_completion_length: int = mirror(64)
    answers_per_thought: int = option(4, "multi_answer: answers sampled per thought (M). A prompt then trains K "
                                      "thoughts and K x M answers, and per_device_train_batch_size counts them all (a "
                                      "multiple of K x (1 + M)).", bounds=INTEGER_AT_LEAST_1)
    thought_end: Optional[str] = option(None, "multi_answer: the text that ends a thought (kept in it; answers "
                                        "continue after it). None: the task's own (chain_arithmetic: '\\boxed{', "
                                        "the start of its answer), else '</think>'.")
    max_thought_length: int = option(48, "multi_answer: most tokens of a thought; answers get max_completion_length "
                                     "tokens each.", bounds=INTEGER_AT_LEAST_1)


class MultiAnswer(RolloutMode):
    name = "multi_answer"
    summary = "GRPO-MA: num_generations thoughts per prompt, answers_per_thought answers each"
    options = MultiAnswerOptions

    def group_size(self, c) -> int:  # K thoughts and K x M answers
        return c.num_generations * (1 + c.answers_per_thought)

    def graded_per_prompt(self, c) -> int:  # the answers are graded, not the thoughts
        return c.num_generations * c.answers_per_thought

    def max_sequence_completion(self, c) -> int:  # a thought and an answer
        return c.max_thought_length + c.max_completion_length

    def group_text(self, c) -> str:
        return f"num_generations x (1 + answers_per_thought) = {self.group_size(c)} with rollout_mode='multi_answer'"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed):
        assert c.thought_end is not None, "multi_answer samples with thought_end resolved (GenerateOptions.from_config)"
        return thoughts_and_answers(engine, tokenizer, prompts, rows, c, c.thought_end, seed, sampling=sampling)

    def advantages(self, batch, c, judge=None, *, world=None):
        import torch

        from ... import objective

        K, M = c.num_generations, c.answers_per_thought
        batch.trained_rewards = batch.rewards
        total = torch.nan_to_num(objective.weighted_rewards(batch.rewards, c.reward_weights), nan=0.0).view(-1, K * (1 + M))
        thought, answer = objective.thought_answer_advantages(total[:, K:].reshape(-1, K, M))
        adv = torch.cat([thought, answer.flatten(1)], dim=1)
        return adv.reshape(-1).float(), {"multi_answer/thought_advantage_abs_mean": thought.abs().mean().item()}


def end_of_thought(tokenizer, token_ids: list[int], thought_end: str) -> int:
    """The number of tokens up to the one that completes the first `thought_end`; len(token_ids) if
    the text never holds it. (A prefix that holds it stays holding it: bisect on the prefix length.)"""
    holds = lambda k: thought_end in tokenizer.decode(token_ids[:k], skip_special_tokens=True)  # noqa: E731
    if not holds(len(token_ids)):
        return len(token_ids)
    lo, hi = 0, len(token_ids)  # holds(hi), not holds(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def thoughts_and_answers(engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], c, thought_end: str,
                         next_seed: Callable[[], int], *, sampling: SamplingOptions):
    """GRPO-MA's thoughts and answers as `Rollouts`: `len(prompt_ids) * K * (1 + M)` entries (module docstring;
    c: MultiAnswerOptions)."""
    from ..batch import Entries

    K, M = c.num_generations, c.answers_per_thought
    groups = engine.generate(prompt_ids, n=K, max_new_tokens=c.max_thought_length,
                             seed=prompt_seeds(next_seed(), len(prompt_ids)), sampling=sampling)
    thoughts = []  # (token ids, log-probs, finish reason) per prompt and thought
    for group in groups:
        for t in group:
            k = end_of_thought(tokenizer, t.token_ids, thought_end)
            if k == len(t.token_ids) and t.finish_reason == "stop":
                k -= 1  # ended by EOS before thought_end: the answers continue without it
            reason = "stop" if k < len(t.token_ids) or t.finish_reason == "stop" else "length"
            thoughts.append((t.token_ids[:k], t.logprobs[:k], reason))
    requests = [p + thoughts[i * K + j][0] for i, p in enumerate(prompt_ids) for j in range(K)]
    answers = engine.generate(requests, n=M, max_new_tokens=c.max_completion_length,
                              seed=prompt_seeds(next_seed(), len(requests)), sampling=sampling)
    out = Entries()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for i, (prompt, row) in enumerate(zip(prompt_ids, rows, strict=True)):
        for j in range(K):
            ids, logp, reason = thoughts[i * K + j]
            out.add(prompt, row, ids, logp, [True] * len(ids), reason, decode(ids), "thought")
        for j in range(K):
            ids = thoughts[i * K + j][0]
            for a in answers[i * K + j]:
                out.add(prompt, row, ids + a.token_ids, [math.nan] * len(ids) + a.logprobs,
                        [False] * len(ids) + [True] * len(a.token_ids), a.finish_reason, decode(ids + a.token_ids),
                        "answer")
    return out.rollouts()


register(MultiAnswer())

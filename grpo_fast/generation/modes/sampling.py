"""How a group is sampled, for the GRPO variants that change it (`GRPOConfig.rollout_mode`).

Both modes continue given prefixes with n samples through the one engine interface (prompt +
prefix is a longer prompt; vLLM's prefix cache makes the shared part cheap), so both engines run
both. Each entry of the returned `Rollouts` is one trained sequence; tokens the policy did not
sample for it are masked out of the loss (`loss_mask`) and carry a NaN sampling log-prob.

early_exit (S-GRPO), per prompt: one full completion; m cut positions spread over its tokens (one
drawn uniformly in each of m equal spans, seeded; distinct unless the completion is shorter than m,
which is warned about); each cut continues from prompt + prefix +
`early_exit_text` for at most `early_exit_answer_length` tokens. The serial group, in exit order,
is the m cuts (shortest first), then the full completion. A cut trains on prefix + injected text +
answer with the injected text masked, and is graded on its answer alone.

multi_answer (GRPO-MA), per prompt: K = num_generations thoughts, each ended at the first
`thought_end` (kept) or at `max_thought_length` tokens (an ending EOS is dropped: the answers
continue the thought); then M = answers_per_thought answers sampled from prompt + thought. The
entries are the K thoughts, then thought 1's M answers, thought 2's, ...; a thought trains as its
own sequence, an answer as thought + answer with the thought masked, graded on the whole text.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Callable

import torch

from ..batch import Rollouts
from ..engines.base import SamplingOptions, prompt_seeds

logger = logging.getLogger(__name__)
_warned = {"short": False}


def _entry(batch: dict, prompt, row, ids, logp, mask, reason, text, kind) -> None:
    batch["prompt_ids"].append(prompt)
    batch["rows"].append(row)
    batch["completion_ids"].append(list(ids))
    batch["sampling_logp"].append(torch.tensor(logp, dtype=torch.float32))
    batch["loss_mask"].append(torch.tensor(mask, dtype=torch.bool))
    batch["finish_reason"].append(reason)
    batch["completion_texts"].append(text)
    batch["kind"].append(kind)


def _empty() -> dict:
    return {k: [] for k in ("prompt_ids", "rows", "completion_ids", "sampling_logp", "loss_mask", "finish_reason",
                            "completion_texts", "kind")}


def cut_positions(length: int, m: int, rng: random.Random) -> list[int]:
    """m prefix lengths in [0, length), non-decreasing: one drawn uniformly in each of m equal spans
    (span i holds the positions in [i length / m, (i + 1) length / m)). With length >= m every span
    holds a position and the cuts are distinct; a shorter length has fewer positions than cuts, so
    some coincide (`early_exit` warns)."""
    if length < m:
        return [min(int((i + rng.random()) * length / m), max(length - 1, 0)) for i in range(m)]
    bounds = [-(-i * length // m) for i in range(m + 1)]  # ceil(i length / m): span i is [bounds[i], bounds[i + 1])
    return [lo + int(rng.random() * (hi - lo)) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def early_exit(engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], c, next_seed: Callable[[], int], *,
               sampling: SamplingOptions) -> Rollouts:
    """S-GRPO's serial groups: `len(prompt_ids) * (early_exit_points + 1)` entries (module docstring)."""
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
    out = _empty()
    for i, (prompt, row, completion) in enumerate(zip(prompt_ids, rows, full, strict=True)):
        for j, k in enumerate(cuts[i]):
            answer = answers[i * m + j]
            _entry(out, prompt, row, completion.token_ids[:k] + injected + answer.token_ids,
                   completion.logprobs[:k] + [math.nan] * len(injected) + answer.logprobs,
                   [True] * k + [False] * len(injected) + [True] * len(answer.token_ids),
                   answer.finish_reason, answer.text, "cut")
        _entry(out, prompt, row, completion.token_ids, completion.logprobs, [True] * len(completion.token_ids),
               completion.finish_reason, completion.text, "full")
    return Rollouts(**out)


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


def multi_answer(engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], c, thought_end: str,
                 next_seed: Callable[[], int], *, sampling: SamplingOptions) -> Rollouts:
    """GRPO-MA's thoughts and answers: `len(prompt_ids) * K * (1 + M)` entries (module docstring)."""
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
    out = _empty()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for i, (prompt, row) in enumerate(zip(prompt_ids, rows, strict=True)):
        for j in range(K):
            ids, logp, reason = thoughts[i * K + j]
            _entry(out, prompt, row, ids, logp, [True] * len(ids), reason, decode(ids), "thought")
        for j in range(K):
            ids = thoughts[i * K + j][0]
            for a in answers[i * K + j]:
                _entry(out, prompt, row, ids + a.token_ids, [math.nan] * len(ids) + a.logprobs,
                       [False] * len(ids) + [True] * len(a.token_ids), a.finish_reason, decode(ids + a.token_ids),
                       "answer")
    return Rollouts(**out)

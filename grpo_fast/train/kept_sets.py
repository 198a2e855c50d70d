"""Truncated sampling in the trainer (top_k, top_p < 1, min_p > 0; generation/truncation.py): where a batch's kept
sets come from, rebuilding them from the old policy, and the engine-vs-trainer figures over them.

The kept set of each sampled token is the support of every distribution the trainer compares with the engine's
log-prob: the loss's log-probs, the old-policy and reference log-probs, the IS weights, KL and the sampling/
figures are all log-softmaxes over it (`objective.KeptSets` in the fused ops); so are the entropy metric and the
entropy bonus: the entropy of the distribution the engine sampled from. Without truncation nothing here runs.

Where the sets come from (`KeptSource`, resolved once at build; the run's first lines say which):
- "engine": the engine returns them with each completion (the HF engine from its warpers; vLLM's
  `return_sampling_mask` where its Model Runner V2 runs), and the rollout mode keeps them (`carries_kept_sets`);
- "reconstructed": the first pass of the old policy over the batch rebuilds them with vLLM's rule from its own
  logits (`ops.linear_topk`: one vocab pass, the k largest and the lse; `truncation.kept_from_candidates`), the
  sampled token kept where rounding put it at the edge (counted: `sampling/kept_set_misses`). That pass is the
  log-probs stage's old-policy pass where one runs (more than one update per batch, a reference, the sampling
  check), else the step's own forward (one update per batch: its hidden states are the old policy's). A batch that
  came without its sets whatever the source (a partial-rollout round mixing members with and without them) is
  rebuilt the same way: nothing is ever scored over the whole vocabulary under truncation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..generation.truncation import SOURCES, KeptTokens, Truncation, kept_from_candidates, unpack
from ..ops import linear_topk

RATIO_BAND = (0.9, 1.1)  # the engine-vs-trainer ratio's band (TRL PR #7269's table): the share outside it is logged


@dataclass(frozen=True)
class KeptSource:
    """The run's truncation rule and where its kept sets come from: None (no truncation), "engine" or
    "reconstructed" (module docstring)."""

    rule: Truncation
    source: Optional[str]

    @classmethod
    def resolve(cls, sampling, engine, mode) -> "KeptSource":
        """From the run's `SamplingOptions`, its engine (`returns_kept_sets`) and its rollout mode
        (`carries_kept_sets`)."""
        rule = Truncation.of(sampling)
        if not rule.active:
            return cls(rule, None)
        returned = engine.returns_kept_sets and mode.carries_kept_sets
        return cls(rule, "engine" if returned else "reconstructed")

    @property
    def active(self) -> bool:
        return self.source is not None

    @property
    def rebuilds(self) -> bool:
        return self.source == "reconstructed"

    def line(self) -> str:
        """The run's first lines: the truncation and the sets' source."""
        how = SOURCES[self.source] + (" with vLLM's rule (min_p, top_k, top_p), the sampled token kept at the edge"
                                      if self.rebuilds else "")
        return f"truncated sampling ({self.rule.describe()}): kept sets {how}; every log-softmax runs over them"


def rebuild(hidden, weight, bias, mb, sampled: torch.Tensor, rule: Truncation, logit_map: dict, backend: str):
    """The kept sets of micro-batch `mb` from the old policy's hidden states `hidden` (b, Tc, H), at the positions
    the engine sampled (`sampled` (b, Tc) bool; the others get empty sets: the whole vocabulary).
    logit_map: temperature, logit_scale, logit_softcap (the sampler's logits). Returns (`objective.KeptSets` over
    the (b, Tc) positions, one `KeptTokens` per sequence, sampled tokens outside the rule's sets, the full-vocab
    log-probs (b, Tc) of the targets: the kept mass's other half)."""
    from ..objective import KeptSets

    b, width = mb.target_ids.shape
    flat = sampled.reshape(-1).nonzero().squeeze(-1)
    h = hidden.detach().reshape(b * width, -1).index_select(0, flat).to(weight.dtype)
    targets = mb.target_ids.reshape(-1).index_select(0, flat)
    if rule.top_k > weight.shape[0]:  # (top_k beyond the vocabulary keeps every token: vLLM's no top-k)
        rule = dataclasses.replace(rule, top_k=weight.shape[0])
    top = linear_topk(h, weight, targets, bias=bias, k=rule.top_k, backend=backend, **logit_map)
    ids, offsets, misses = kept_from_candidates(top.values, top.ids, top.lse, rule, sampled=targets)
    counts = torch.zeros(b * width, dtype=torch.int64, device=offsets.device)
    counts[flat.to(offsets.device)] = offsets.diff()
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    full = torch.zeros(b * width, dtype=torch.float32, device=top.lse.device)
    full[flat.to(full.device)] = top.target_logit - top.lse
    lengths = mb.completion_mask.sum(dim=1).tolist()
    kept = KeptSets(ids.to(mb.target_ids.device), offsets.to(mb.target_ids.device))
    return kept, unpack(ids, offsets, lengths, width), misses, full.view(b, width)


def sampled_positions(mb, sampling_logp) -> torch.Tensor:
    """(b, Tc) bool: the completion tokens of `mb` the engine sampled (a NaN sampling log-prob marks one it did not:
    injected text, a tool result)."""
    return mb.completion_mask & ~mb.pad(sampling_logp, fill=float("nan")).isnan()


class TruncationStats:
    """The engine-vs-trainer figures of a batch's sampled tokens: the ratio exp(trainer - engine) (its mean and
    the share outside `RATIO_BAND`), and under truncation the mass the truncation cut (1 - the kept set's
    probability under the trainer's full-vocab distribution) and the sampled tokens a rebuilt set missed."""

    def __init__(self, source: Optional[KeptSource] = None):
        self.truncated = source is not None and source.active  # (every rank alike: its collectives meet)
        self.rebuilt = False  # this pass rebuilds the sets (its caller says so, alike on every rank: a collective)
        self.diffs, self.cut, self.misses = [], [], 0

    def missed(self, count: int) -> None:
        """Sampled tokens a rebuilt kept set left out (then added to it)."""
        self.misses += int(count)

    def add(self, trainer: torch.Tensor, sampling: torch.Tensor, full: Optional[torch.Tensor] = None) -> None:
        """One completion's log-probs `[C]`: the trainer's (over the kept sets), the engine's (NaN: not sampled),
        and with truncation the trainer's over the whole vocabulary."""
        sampled = ~sampling.isnan()
        self.diffs.append((trainer.float() - sampling.float())[sampled])
        if full is not None:
            self.cut.append(-torch.expm1(full.float() - trainer.float())[sampled])

    def metrics(self, world=None) -> dict:
        from ..distributed import ONE_PROCESS, gather_rows, sum_over_ranks

        world = world or ONE_PROCESS
        out = {}  # (every collective below runs on every rank: the flags are alike there)
        diffs = gather_rows(torch.cat(self.diffs) if self.diffs else torch.zeros(0), world)
        if diffs.numel():
            ratio = diffs.exp()
            lo, hi = RATIO_BAND
            out["sampling/engine_ratio_mean"] = ratio.mean().item()
            out["sampling/engine_ratio_outside"] = ((ratio < lo) | (ratio > hi)).float().mean().item()
        if self.truncated:
            cut = gather_rows(torch.cat(self.cut) if self.cut else torch.zeros(0), world)
            if cut.numel():
                out["sampling/kept_mass_mean"] = cut.mean().item()
        if self.rebuilt:
            out["sampling/kept_set_misses"] = sum_over_ranks([self.misses], world)[0]
        return out


@dataclass
class PolicyPass:
    """What the old policy's no-grad pass over a batch gives under truncation: per completion its log-probs over
    the kept sets and over the whole vocabulary, the kept sets where it rebuilt them, and the sampled tokens those
    missed."""

    logp: list
    full: list
    kept: Optional[list]
    misses: int


@torch.no_grad()
def policy_pass(model, packer, batch, source: KeptSource, *, temperature: float, backend: str,
                routed_experts=None) -> PolicyPass:
    """The old policy's log-probs of `batch`'s completions (`forward.completion_logprobs` under truncation): over
    the batch's kept sets, or over the sets this pass rebuilds where it has none (not returned, or not yet)."""
    from ..models import routing
    from ..models.adapter import causal_lm_of, logit_transform
    from ..ops import masked_linear_logprobs
    from .forward import _without_dropout, completion_hidden, policy_parts

    base, weight, bias = policy_parts(model)
    logit_map = {"temperature": temperature, **logit_transform(causal_lm_of(model).config)}
    n = len(batch.prompt_ids)
    logp, full = [torch.zeros(0) for _ in range(n)], [torch.zeros(0) for _ in range(n)]
    rebuilding = batch.kept is None  # (rebuilt where the batch came without them: also a mixed partial-rollout round)
    kept = [KeptTokens.none(0) for _ in range(n)] if rebuilding else None
    misses = 0
    micro_batches = packer.micro_batches(batch.prompt_ids, batch.completion_ids, routed_experts=routed_experts,
                                         kept=None if rebuilding else batch.kept, images=batch.image_inputs)
    for mb in _without_dropout(model, micro_batches):
        with routing.replaying(base, mb.routing):
            hidden = completion_hidden(base, mb, packer.amp_dtype)
        if rebuilding:
            mb.kept, sets, missed, whole = rebuild(hidden, weight, bias, mb, sampled_positions(mb, batch.sampling_logp),
                                                   source.rule, logit_map, backend)
            misses += missed
            for i, s in zip(mb.rows, sets, strict=True):
                kept[i] = s
        else:
            whole = masked_linear_logprobs(hidden, weight, mb.target_ids, mb.completion_mask, bias=bias,
                                           backend=backend, **logit_map)
        values = masked_linear_logprobs(hidden, weight, mb.target_ids, mb.completion_mask, bias=bias, kept=mb.kept,
                                        backend=backend, **logit_map)
        for i, v, w in zip(mb.rows, mb.unpad(values), mb.unpad(whole), strict=True):
            logp[i], full[i] = v.cpu(), w.cpu()
    return PolicyPass(logp, full, kept, misses)

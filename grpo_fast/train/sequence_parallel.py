"""Sequence parallelism (`sequence_parallel_size` N > 1): one packed row's tokens spread over the N ranks of a group.

Generation is unchanged: every rank samples, scores and computes advantages for its own share of the groups.
The training passes then run on the union of the group's shares (`Group.union`, in rank order, so with one
data-parallel group the union is the whole global batch in one process's order), packed exactly as one process
would pack it; each packed row is then cut into N contiguous shards (`shard`), one per rank:

- targets, positions and the completion layout are built on the WHOLE row before the cut (`pack_sequences`:
  the last completion token a target only, positions restarting per sequence). A completion token belongs to
  the rank holding the hidden state that predicts it, so a sequence cut at a shard edge keeps its right target
  (verl#6068 rolled the labels after slicing: one wrong label per rank and micro-batch).
- a row N does not divide is padded at its end, the padding appended to its last sequence: attention is causal, so
  no real token sees it, and no completion position reads it. (A padding sequence of its own would cost a whole
  row: the per-sequence SDPA pads every sequence to the longest, which doubled each rank's attention memory.)
- every per-token input (loss mask, advantages, old / reference log-probs, IS weights, tool masks) keeps the
  row's (b, Tc) layout: the same boundaries on every rank, nothing sliced apart from the hidden states.
- the decoder runs on the shard; attention gathers the row through Ulysses' all-to-all (`train/ulysses.py`).
- the loss: each rank computes the fused log-probs (and entropies) of ITS completion tokens from its hidden
  states and the lm_head (the temperature and the model's logit map applied there, on every shard: verl#5957),
  and the group sums them (`group_sum`, differentiable: each position is owned by one rank, the others add 0).
  Every rank then holds the micro-batch's whole log-probs and computes the spec's loss on them
  (`objective.grpo_loss_from_logprobs`): every normalisation (token, sequence, group, max_completion_length)
  counts over the whole row, and every sequence-level quantity (GSPO's and luspo's sequence ratio, vespo's
  weight, the off-policy mask, KL and entropy means) sums whole sequences, so nothing differs from one process.
  The backward of the sum is a sum: each rank's log-probs get N times the gradient, which the N-fold mean of
  DDP / FSDP2 over the group's ranks cancels.
- log-probs a stage needs whole (old policy, reference, the IS weights, TRL's token masks) come back summed
  over the group the same way (`completion_logprobs`, `logprobs`).

The price against N = 1: the fused op's one-pass gradient (3 lm_head matmuls) gives way to the log-prob op's
recompute in backward (4), the route sequence-level losses always take; the all-to-alls (4 tensors a layer,
twice with the backward, bytes in `benchmarks/bench_sequence_parallel.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import objective
from ..compat import attention_implementation
from ..generation.batch import Rollouts
from ..models.adapter import causal_lm_of, logit_transform, masked_logprobs
from ..models.moe import router_loss
from ..models.vision import is_vision_language
from ..ops import masked_linear_logprobs
from . import ulysses
from .forward import _without_dropout, completion_hidden, policy_parts
from .packing import PackedMicroBatch, block_causal_mask


@dataclass(frozen=True)
class Group:
    """This rank's sequence-parallel group: its place in it, its size, the process group."""

    rank: int
    size: int
    handle: object

    def gather(self, obj) -> list:
        """Every rank's picklable `obj`, in group order."""
        parts: list = [None] * self.size
        dist.all_gather_object(parts, obj, group=self.handle)
        return parts

    def union(self, batch: Rollouts) -> Rollouts:
        """The group's completions with what training reads (ids, masks, advantages, side inputs), in rank order."""
        parts = self.gather(_trainable(batch))
        return Rollouts.concat(parts)

    def own(self, sizes: list[int]) -> slice:
        """This rank's entries in a union of parts of `sizes` (in rank order)."""
        start = sum(sizes[: self.rank])
        return slice(start, start + sizes[self.rank])


def group_of(parallel) -> Optional[Group]:
    """The group of a `distributed.Parallel` (or a World), or None without sequence parallelism."""
    world = getattr(parallel, "world", parallel)
    if getattr(world, "sp_size", 1) <= 1:
        return None
    return Group(world.sp_rank, world.sp_size, world.sp_group)


def _trainable(batch: Rollouts) -> Rollouts:
    """`batch` without what training never reads (rows, texts, environments: not picklable, or large)."""
    n = len(batch)
    return dataclasses.replace(batch, rows=[{}] * n, completion_texts=[""] * n, messages=None, environments=None,
                               rewards=None, trained_rewards=None, stats={}, image_inputs=None)


# ---- checks before any work ------------------------------------------------------------------


def check_model(model, n: int, router_aux_loss_coef: Optional[float] = None) -> None:
    """What sequence parallelism needs of the model, refused in one line: the head rule, attention called through
    transformers' interface (so Ulysses can wrap it), no attention sinks, no MoE router loss."""
    if n <= 1:
        return
    lm = causal_lm_of(model)
    name = type(lm).__name__
    if is_vision_language(lm.config):
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid for {name}: a vision-language model's "
                         f"image features and 3-D positions are not sharded yet; use 1")
    ulysses.check_heads(lm.config, n)
    if not getattr(lm, "_supports_attention_backend", False):
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid for {name}: its attention is not called "
                         f"through transformers' attention interface, which Ulysses wraps; use 1")
    if any(getattr(m, "sinks", None) is not None for m in lm.modules()):
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid for {name}: attention sinks are per head "
                         f"and read whole by the model's attention, which Ulysses' head scatter would need sliced "
                         f"(not implemented); use 1")
    if router_loss(lm, router_aux_loss_coef) is not None:
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid with the MoE router loss on "
                         f"(router_aux_loss_coef, or the model config's): the Switch loss multiplies means over a row's tokens, not "
                         f"combined across shards yet; set router_aux_loss_coef=0 or use 1")


def packer_attention(model, n: int) -> Optional[str]:
    """The packer's attention under sequence parallelism (None: the packer's own choice, N = 1): flash's varlen,
    else grpo_fast's per-sequence SDPA even under gradient checkpointing (the Ulysses swap spans the backward, so
    the recompute attends alike), else the dense mask (soft-capping models)."""
    if n <= 1:
        return None
    lm = causal_lm_of(model)
    if "flash" in attention_implementation(lm.config):
        return "varlen"
    return "mask" if getattr(lm.config, "attn_logit_softcapping", None) is not None else "packed"


# ---- one packed row, split ----------------------------------------------------------------------


@dataclass
class ShardedMicroBatch(PackedMicroBatch):
    """A packed micro-batch as one rank of its group runs it: the decoder's inputs are this rank's contiguous
    shard of the (padded) row; `owned` (b, Tc) marks the completion positions whose predicting hidden state is
    here, and `hidden_index` (1, n_own) is where, in the shard, in `owned`'s row-major order: the hidden states a
    forward returns are this rank's [1, n_own, H] alone, never the micro-batch's (b, Tc, H), whose size would not
    shrink with N (`own` and `spread` move a (b, Tc) tensor to that layout and back). Everything else (target_ids,
    completion_mask, rows: the whole micro-batch) is the row's, alike on every rank."""

    owned: Optional[torch.Tensor] = None
    shard_inputs: Optional[dict] = None
    inner: str = "packed"  # the attention behind the all-to-all (train/ulysses.py)
    group: Optional[Group] = None
    shard_tokens: int = 0  # real (not padding) tokens of the row in this shard

    @property
    def num_tokens(self) -> int:
        return self.shard_tokens

    def model_inputs(self) -> dict:
        return dict(self.shard_inputs)

    def own(self, values: torch.Tensor) -> torch.Tensor:
        """(b, Tc) -> (1, n_own): the values at this rank's positions, in `hidden_index`'s order."""
        return values[self.owned][None]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """(1, n_own) -> (b, Tc), 0 at the positions other ranks own (differentiable)."""
        return torch.zeros(self.owned.shape, dtype=values.dtype, device=values.device).masked_scatter(self.owned, values[0])


def shard(mb: PackedMicroBatch, group: Group, model) -> ShardedMicroBatch:
    """This rank's shard of `mb`'s row (module docstring). model: the decoder (the eager mask's dtype)."""
    if mb.routing is not None or mb.kept is not None or mb.images is not None:
        raise ValueError("sequence parallelism: routing replay, truncated sampling's kept sets and a VLM's images are "
                         "not sharded (refused before any work: config_checks, check_model)")
    length, n = mb.num_tokens, group.size
    size = -(-length // n)  # tokens per shard
    pad = size * n - length
    start = group.rank * size
    device = mb.input_ids.device
    lengths = (mb.cu_seq_lens[1:] - mb.cu_seq_lens[:-1]).tolist()
    lengths[-1] += pad  # (the padding continues the last sequence: module docstring)
    ids = torch.cat([mb.input_ids, mb.input_ids.new_zeros(1, pad)], dim=1)
    positions = torch.cat([mb.position_ids, mb.position_ids[:, -1:] + 1 + torch.arange(pad, device=device)[None]], dim=1)
    inputs = {"input_ids": ids[:, start: start + size], "position_ids": positions[:, start: start + size],
              "use_cache": False}
    inner = mb.attention
    if inner in ("packed", "varlen"):
        inputs["cu_seq_lens_q"] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    else:  # the dense mask of the padded row
        mask = block_causal_mask(lengths, device)
        if attention_implementation(model.config) == "eager":  # additive, as forward.completion_hidden makes it
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        inputs["attention_mask"] = mask
    local = mb.hidden_index - start
    owned = mb.completion_mask & (local >= 0) & (local < size)
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(PackedMicroBatch)}
    fields.update(hidden_index=local[owned][None], attention="sequence_parallel", attention_mask=None)
    return ShardedMicroBatch(**fields, owned=owned, shard_inputs=inputs, inner=inner, group=group,
                             shard_tokens=max(0, min(length - start, size)))


def shard_all(micro_batches: list, group: Optional[Group], model) -> list:
    """Each micro-batch's shard on this rank (as they are without sequence parallelism)."""
    return micro_batches if group is None else [shard(mb, group, model) for mb in micro_batches]


def attending(model, mb) -> contextlib.AbstractContextManager:
    """Hold over a micro-batch's forward AND backward: a sharded one attends through Ulysses (the recompute of
    gradient checkpointing too); any other as it would."""
    if not isinstance(mb, ShardedMicroBatch):
        return contextlib.nullcontext()
    return ulysses.attending(model, mb.group.handle, mb.inner)


# ---- the group's sums ---------------------------------------------------------------------------


class _GroupSum(torch.autograd.Function):
    """The sum over the group's ranks; its gradient is the sum of theirs (every rank computes the same loss from
    the sum, so each gets N times its share: DDP's and FSDP2's mean over the N ranks cancels it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def group_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _GroupSum.apply(x, group.handle)


def logprobs(hidden, weight, bias, mb: ShardedMicroBatch, mask, options) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's whole (log-probs, entropies) (b, Tc) where `mask` is set, no grad: each rank's own
    positions from its hidden states [1, n_own, H], summed over the group (train/step.py's `_logprobs` under
    sequence parallelism)."""
    logp, entropy = masked_logprobs(hidden, weight, bias, mb.own(mb.target_ids), mb.own(mask.bool()), options=options)
    return group_sum(mb.spread(logp), mb.group), group_sum(mb.spread(entropy), mb.group)


def loss_of(mb: ShardedMicroBatch):
    """`ops.fused_linear_grpo_loss`'s call for a sharded micro-batch, its hidden states this rank's [1, n_own, H]
    and every other tensor the micro-batch's (b, Tc): (loss, metrics), each alike on every rank."""

    def loss(hidden, weight, target_ids, advantages, mask, *, old_logp=None, ref_logp=None, is_weights=None,
             is_ratio=None, entropy_weights=None, bias=None, num_items_in_batch=None, options, kept=None):
        objective.check_loss_inputs(target_ids.shape, options, target_ids=target_ids, advantages=advantages,
                                    mask=mask, old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights,
                                    is_ratio=is_ratio, entropy_weights=entropy_weights)
        if tuple(hidden.shape[:2]) != (1, int(mb.owned.sum())):
            raise ValueError(f"hidden must be this rank's [1, {int(mb.owned.sum())}, H] (its owned positions), got "
                             f"{list(hidden.shape)}")
        bonus = options.entropy_coef != 0.0
        logp, entropy = masked_linear_logprobs(
            hidden.to(weight.dtype), weight, mb.own(target_ids), mb.own(mask.bool()), bias=bias,
            temperature=options.temperature, logit_scale=options.logit_scale, logit_softcap=options.logit_softcap,
            backend=options.backend, return_entropy=True, differentiable_entropy=bonus)
        logp, entropy = group_sum(mb.spread(logp), mb.group), group_sum(mb.spread(entropy), mb.group)
        if old_logp is not None:  # masked places take the old log-prob (ratio 1), as the fused op's
            logp = torch.where(mask.bool(), logp, old_logp.detach().float())
        num_items = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=torch.float32)
        total, metrics = objective.grpo_loss_from_logprobs(
            logp, advantages, mask, options, entropy=entropy if bonus else entropy.detach(), old_logp=old_logp,
            ref_logp=ref_logp, is_weights=is_weights, is_ratio=is_ratio, entropy_weights=entropy_weights,
            num_items_in_batch=num_items)
        return total, {name: metrics[name] for name in objective.metric_names(options)}

    return loss


# ---- the no-grad passes over whole sequences ------------------------------------------------------


@torch.no_grad()
def completion_logprobs(model, packer, prompt_ids, completion_ids, *, temperature: float, backend: str,
                        group: Group, routed_experts=None, kept=None, images=None) -> list[torch.Tensor]:
    """`forward.completion_logprobs` under sequence parallelism: the group's union packed and sharded as in
    training, each completion's log-probs whole (summed over the group); returns this rank's own entries'."""
    if routed_experts is not None or kept is not None or (images is not None and any(x is not None for x in images)):
        raise ValueError("sequence parallelism: routing replay, kept sets and images are not sharded (refused before "
                         "any work: config_checks, check_model)")
    parts = group.gather((list(prompt_ids), list(completion_ids)))
    prompts = [p for part in parts for p in part[0]]
    completions = [c for part in parts for c in part[1]]
    base, weight, bias = policy_parts(model)
    logit_map = logit_transform(causal_lm_of(model).config)
    out = [torch.zeros(0) for _ in prompts]
    for mb in _without_dropout(model, packer.micro_batches(prompts, completions)):
        mb = shard(mb, group, base)
        with attending(base, mb):
            hidden = completion_hidden(base, mb, packer.amp_dtype)
        logp = masked_linear_logprobs(hidden, weight, mb.own(mb.target_ids), mb.own(mb.owned), bias=bias,
                                      temperature=temperature, **logit_map, backend=backend)
        for i, values in zip(mb.rows, mb.unpad(group_sum(mb.spread(logp), group)), strict=True):
            out[i] = values.cpu()
    return out[group.own([len(part[0]) for part in parts])]

"""Many processes under torchrun: the world a trainer runs in, the few collectives its step needs,
and the policy wrapped for data parallelism.

One process per GPU (NCCL) or per CPU slot (gloo). Each rank samples, scores and trains on its own
whole groups; DDP averages the gradients. What must be global is made so here: the dapo
normaliser (the all-rank token count), the skip decision of a step, the adaptive entropy
controller's entropy, and the logged metrics (means over ranks, written by rank 0). A single process
(no WORLD_SIZE, or 1) has `World()` and none of this runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """The rank that writes files: metrics, checkpoints, the progress bar."""
        return self.rank == 0


ONE_PROCESS = World()


def join() -> World:
    """The torchrun world of this process (its default group made if nobody made it yet: NCCL with
    one GPU per rank, else gloo), or ONE_PROCESS."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return ONE_PROCESS
    if not dist.is_initialized():
        if torch.cuda.is_available():  # NCCL for the gradients, gloo for the small CPU reductions below
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return World(dist.get_rank(), dist.get_world_size())


def check_config(config) -> None:
    """What many ranks do not run yet, refused by name before any work."""
    rules = [("rollout_mode", config.rollout_mode != "parallel", "the early_exit and multi_answer modes run in one process for now"),
             ("dynamic_sampling", config.dynamic_sampling, "its extra rounds would differ per rank"),
             ("max_staleness", config.max_staleness > 0, "partial rollouts run in one process for now")]
    for name, refused, why in rules:
        if refused:
            raise ValueError(f"GRPOConfig.{name}={getattr(config, name)!r} is not supported under torchrun (WORLD_SIZE="
                             f"{os.environ.get('WORLD_SIZE')}) yet: {why}; run it in one process")


def sum_over_ranks(values: list[float], world: World) -> list[float]:
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def gather_rows(rows: torch.Tensor, world: World) -> torch.Tensor:
    """Every rank's `rows` (any number each, the same trailing shape), concatenated in rank order."""
    if world.size == 1:
        return rows
    parts: list[Optional[torch.Tensor]] = [None] * world.size
    dist.all_gather_object(parts, rows)
    return torch.cat(parts)


def any_rank(flag: bool, world: World) -> bool:
    return bool(sum_over_ranks([float(flag)], world)[0])


# Metrics that are not a mean over the ranks: counts add up, extremes stay extremes.
_SUMMED = ("num_tokens", "tokens_per_second", "rewards/non_finite", "num_micro_batches")


def reduce_metrics(metrics: dict, world: World) -> dict:
    """One value per metric over the ranks that have a finite one (the union of their names): sums
    for counts, min / max for extremes, else the mean (NaN where no rank has a value)."""
    if world.size == 1:
        return metrics
    gathered: list[Optional[dict]] = [None] * world.size
    dist.all_gather_object(gathered, metrics)
    out = {}
    for name in dict.fromkeys(n for m in gathered for n in m):
        values = [m[name] for m in gathered if isinstance(m.get(name), (int, float)) and math.isfinite(m[name])]
        if not values:
            out[name] = float("nan")
        elif name in _SUMMED:
            out[name] = sum(values)
        elif name.endswith(("min_length", "/min")):
            out[name] = min(values)
        elif name.endswith(("max_length", "/max")):
            out[name] = max(values)
        else:
            out[name] = sum(values) / len(values)
    return out


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


class DecoderForward(torch.nn.Module):
    """The causal LM as DDP's module, its forward the decoder's (to the final hidden states). The
    fused loss reads the lm_head weight without a forward; DDP still reduces its gradient, since its
    hooks sit on every parameter of the module whose forward ran (docs/design.md, the spike)."""

    def __init__(self, lm: torch.nn.Module, decoder: torch.nn.Module):
        super().__init__()
        self.lm, self._decoder = lm, [decoder]  # a list: the decoder is registered once, through lm

    def forward(self, *args, **kwargs):
        return self._decoder[0](*args, **kwargs)


def data_parallel(model: torch.nn.Module, world: World):
    """DDP over the policy (None for one process): call it where the decoder would be called."""
    if world.size == 1:
        return None
    from torch.nn.parallel import DistributedDataParallel

    from ..models.adapter import causal_lm_of, decoder_of

    lm = causal_lm_of(model)
    device = next(lm.parameters()).device
    return DistributedDataParallel(DecoderForward(lm, decoder_of(lm)),
                                   device_ids=[device.index] if device.type == "cuda" else None)

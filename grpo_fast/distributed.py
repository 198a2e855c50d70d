"""Many processes under torchrun: the world a trainer runs in, the few collectives its step needs,
and the policy wrapped for data parallelism (DDP) or sharded (FSDP2).

One process per GPU (NCCL) or per CPU slot (gloo). Each rank samples, scores and trains on its own
whole groups; DDP averages the gradients, FSDP2 reduce-scatters them into its shards. What must be
global is made so here: the dapo normaliser (the all-rank token count), the skip decision of a step,
the adaptive entropy controller's entropy, and the logged metrics (combined over the ranks as
`metrics.reduction` declares each, written by rank 0). A single process (no WORLD_SIZE, or 1) has
`World()` and none of this runs. docs/design.md, "Many ranks", explains the rules that keep FSDP2's
collectives in step.

Sequence parallelism (`sequence_parallel_size` N > 1, Ulysses: grpo_fast/train/sequence_parallel.py) lays the
ranks out as a (dp, sp) mesh, sp fastest: ranks `d*N .. d*N + N-1` form sequence-parallel group d and hold one
contiguous 1/N of every packed row of their group's micro-batches. DDP and FSDP2 still span the whole world
(FSDP2 shards over every rank), so gradients are averaged over dp x N ranks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .bounds import INTEGER_AT_LEAST_1
from .compat import settle_fsdp_root
from .options import option, options_record
from .processes import die_with_launcher


@options_record
@dataclass(frozen=True)
class SequenceParallelOptions:
    """How a packed row is spread over ranks (`distributed.join`)."""

    sequence_parallel_size: int = option(1, "Ulysses sequence parallelism: split every packed micro-batch row into this many contiguous shards, one per rank, so one long sequence's activations are spread over N devices (verl's ulysses_sequence_parallel_size, accelerate's ParallelismConfig(sp_size=...); world size = data-parallel size x N, under torchrun with DDP or FSDP2). Each rank still samples its own share; the N ranks of a group exchange their completions and train on the union. Attention runs after an all-to-all (sequence gathered, heads scattered), so the model's query heads must be a multiple of N and its KV heads a multiple or a divisor of N. 1: off.", bounds=INTEGER_AT_LEAST_1)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    joined: bool = False  # a torch.distributed group spans this world (torchrun), even of one rank
    sp_size: int = 1  # sequence_parallel_size: consecutive ranks sharing the rows of one group's micro-batches
    sp_group: Optional[object] = field(default=None, compare=False, repr=False)  # this rank's group (N > 1)

    @property
    def main(self) -> bool:
        """The rank that writes files: metrics, checkpoints, the progress bar."""
        return self.rank == 0

    @property
    def sp_rank(self) -> int:
        """Which contiguous shard of a packed row this rank holds (0 without sequence parallelism)."""
        return self.rank % self.sp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: ranks / sequence_parallel_size (the ranks without sequence parallelism)."""
        return self.size // self.sp_size


ONE_PROCESS = World()

# (host, pid) of every rank, in rank order, once `join` ran: a rank that sees a collective fail looks
# up which of its peers on this host has died (`dead_peers`)
_peers: list[tuple[str, int]] = []


def join(strategy: str = "auto", sequence_parallel_size: int = 1) -> World:
    """The torchrun world of this process (its default group made if nobody made it yet: NCCL with
    one GPU per rank, else gloo), or ONE_PROCESS. A torchrun world of one rank is one process too,
    unless `distributed_strategy='fsdp2'` asks for FSDP2 there (a check of the sharded path on one GPU).
    sequence_parallel_size N > 1: the (dp, sp) mesh's groups are made too (N must divide the world size:
    refused in one line before any group is made)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    check_sequence_parallel(sequence_parallel_size, size)
    if size == 1 and not (strategy == "fsdp2" and "RANK" in os.environ):
        return ONE_PROCESS
    die_with_launcher()  # (grpo-fast's ranks set it at start; a script of the user's under torchrun here)
    if not dist.is_initialized():
        if torch.cuda.is_available():  # NCCL for the gradients, gloo for the small CPU reductions below
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # torchrun's workers all talk to the agent's store, which outlives a restart: the keys of the
        # failed attempt's process group (gloo's peer addresses) are still there, and a restarted
        # worker that reads them connects to a dead peer ("Gloo connectFullMesh failed ... Connection
        # refused"). So each attempt gets its own key space.
        store, rank, size = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                store=dist.PrefixStore(f"grpo_fast/attempt-{attempt}", store), rank=rank, world_size=size)
    world = World(dist.get_rank(), dist.get_world_size(), joined=True)
    global _peers
    _peers = gather_objects((socket.gethostname(), os.getpid()), world)  # for naming a rank that dies
    if sequence_parallel_size > 1:
        world = World(world.rank, world.size, True, sequence_parallel_size, _sequence_parallel_group(world, sequence_parallel_size))
    return world


def check_sequence_parallel(n: int, world_size: int) -> None:
    """sequence_parallel_size N against the world size, in one line (before any rank works)."""
    if n > 1 and world_size % n:
        raise ValueError(f"GRPOConfig.sequence_parallel_size={n} is invalid: expected a divisor of the number of ranks "
                         f"(WORLD_SIZE={world_size}; ranks = data-parallel size x sequence_parallel_size, under torchrun)")


def _sequence_parallel_group(world: World, n: int):
    """This rank's sequence-parallel group: ranks d*N .. d*N + N-1 (every rank makes every group, in the same
    order, as torch.distributed.new_group requires). gloo: the all-to-alls run on the CPU; with CUDA, NCCL."""
    mine = None
    for first in range(0, world.size, n):
        group = dist.new_group(list(range(first, first + n)))
        if first <= world.rank < first + n:
            mine = group
    return mine


def dead_peers(wait_s: float = 2.0) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host whose process has ended (gone, or a zombie nobody has
    reaped yet), polled for up to `wait_s` seconds: a peer's sockets close while it dies, a moment
    before its process ends. [] in one process or when every peer here lives (other hosts' ranks
    cannot be checked from here)."""
    host, deadline = socket.gethostname(), time.monotonic() + wait_s
    while True:
        dead = [(rank, pid) for rank, (h, pid) in enumerate(_peers) if h == host and pid != os.getpid()
                and not _alive(pid)]
        if dead or not _peers or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` (or what it wraps: a cause, a torch.distributed.checkpoint rank failure) is a
    collective that failed because a peer's connection broke (gloo and NCCL raise RuntimeErrors)."""
    from .errors import chain

    broken = ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
    return any(isinstance(e, getattr(dist, "DistError", ())) or (isinstance(e, RuntimeError) and any(
        s in str(e) for s in broken)) for e in chain(err))


def sum_over_ranks(values: list[float], world: World) -> list[float]:
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def gather_rows(rows: torch.Tensor, world: World) -> torch.Tensor:
    """Every rank's `rows` (any number each, the same trailing shape), concatenated in rank order."""
    return rows if world.size == 1 else torch.cat(gather_objects(rows, world))


def gather_objects(obj, world: World) -> list:
    """Every rank's picklable `obj`, in rank order (one process: [obj])."""
    if world.size == 1:
        return [obj]
    parts: list = [None] * world.size
    dist.all_gather_object(parts, obj)
    return parts


def any_rank(flag: bool, world: World) -> bool:
    return bool(sum_over_ranks([float(flag)], world)[0])


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


class DecoderForward(torch.nn.Module):
    """The causal LM as DDP's or FSDP2's root module, its forward the decoder's (to the final hidden
    states). The fused loss reads the lm_head weight without a forward; DDP still reduces its
    gradient, since its hooks sit on every parameter of the module whose forward ran, and FSDP2's
    root keeps its own parameters (embeddings, final norm, lm_head) unsharded from its forward to
    the end of backward (docs/design.md, the spike)."""

    def __init__(self, lm: torch.nn.Module, decoder: torch.nn.Module):
        super().__init__()
        self.lm, self._decoder = lm, [decoder]  # a list: the decoder is registered once, through lm

    def forward(self, *args, **kwargs):
        return self._decoder[0](*args, **kwargs)


def choose_strategy(model: torch.nn.Module, strategy: str) -> str:
    """ddp or fsdp2 for `distributed_strategy` ("auto": fsdp2 when parameters, the trainable ones' gradients
    and AdamW's two float32 moments would take more than half of one device: a GPU, or this host's RAM shared by
    the ranks on it)."""
    if strategy != "auto":
        return strategy
    params = list(model.parameters())
    if any(not p.requires_grad for p in params):  # a LoRA adapter on a frozen base: FSDP2 with it is refused
        return "ddp"
    # weights, and for the trained ones (all, or a LoRA adapter's) a gradient and AdamW's two moments
    need = sum(p.numel() * (p.element_size() + (p.element_size() + 8 if p.requires_grad else 0)) for p in params)
    device = params[0].device
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "fsdp2" if need > 0.5 * have else "ddp"


class Parallel:
    """The policy (or the frozen reference) on this process's ranks, and the few things the loop asks of it.

    `forward`: what to call where the decoder would be called (the DDP module or the FSDP2 root), or
    None for one process. Under FSDP2 every forward is a collective (each layer is all-gathered), so
    ranks must run the same number of them: `rounds(n)` is the count every rank runs, and passes
    that are not training (the old-policy and reference log-probs, the HF engine's sampling, the
    sync probe) run inside `gathered()`, where the whole model is unsharded
    once (one all-gather per pass, not per micro-batch) and behaves as a plain local model.
    """

    def __init__(self, lm: torch.nn.Module, world: World, strategy: str = "none", forward=None):
        self.lm, self.world, self.strategy, self.forward = lm, world, strategy, forward

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp2"

    def rounds(self, n: int) -> int:
        """Forward and backward passes a step runs when this rank has `n` micro-batches: FSDP2 the
        most of any rank (its forwards are collectives), DDP at least one (its gradient all-reduce
        must meet), one process `n`."""
        if self.strategy == "ddp":
            return max(n, 1)
        if not self.sharded:
            return n
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _units(self) -> dict[str, torch.nn.Module]:
        """The FSDP2 units inside the causal LM by name: its decoder layers (the root wraps the LM)."""
        from torch.distributed.fsdp import FSDPModule

        return {name: m for name, m in self.lm.named_modules() if isinstance(m, FSDPModule)}

    @contextlib.contextmanager
    def gathered(self):
        """The whole model unsharded on every rank (FSDP2; nothing to do otherwise): forwards inside
        are local, so ranks may run different numbers of them. Collective: every rank enters."""
        if not self.sharded:
            yield
            return
        units = list(self._units().values())
        self.forward.unshard()
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)  # stays whole across the forwards inside
        try:
            yield
        finally:
            for unit in units:
                unit.set_reshard_after_forward(True, recurse=False)
                unit.reshard()
            self.forward.reshard()

    def full_state_dict(self) -> Optional[dict]:
        """FSDP2: the whole state dict on rank 0's CPU (empty on the others), for the HF copy of a
        checkpoint; None otherwise (the live module's own). Collective. (FSDP2's state_dict() is
        sharded even inside gathered().)"""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) for every parameter of the causal LM, for the engine's weight sync.

        FSDP2: gathered one decoder layer at a time (the root's parameters first), each yielded as a
        copy before the layer is resharded, so the extra memory is one layer plus the consumer's
        bucket, never the whole model. Collective: every rank iterates to the end, in the same order.
        """
        if not self.sharded:
            yield from self.lm.named_parameters()
            return
        units = self._units()
        self.forward.unshard()
        try:
            in_units = tuple(f"{name}." for name in units)
            for name, param in self.lm.named_parameters():  # the root's own: embeddings, final norm, lm_head
                if not name.startswith(in_units):
                    yield name, param.detach().clone()
            for prefix, unit in units.items():
                unit.unshard()
                for name, param in unit.named_parameters():
                    yield f"{prefix}.{name}", param.detach().clone()
                unit.reshard()
        finally:
            self.forward.reshard()


def parallelize(model: torch.nn.Module, world: World, strategy: str = "auto", frozen: bool = False) -> Parallel:
    """The policy wrapped for `world` (one process: as it is). DDP: the causal LM in
    DistributedDataParallel; FSDP2: `fully_shard` on each decoder layer, then on the root (so
    embeddings, final norm and lm_head are one unit, whole from the root's forward to the end of its
    backward: the fused loss reads the lm_head weight there). frozen: the reference model, which is
    never trained: sharded under FSDP2 like the policy, as it is under DDP."""
    from .models.adapter import causal_lm_of, decoder_of

    lm = causal_lm_of(model)
    if not world.joined or (world.size == 1 and strategy != "fsdp2"):
        return Parallel(lm, world)
    strategy = choose_strategy(lm, strategy)
    decoder = decoder_of(lm)
    root = DecoderForward(lm, decoder)
    if strategy == "ddp":
        if frozen:
            return Parallel(lm, world, "ddp")
        from torch.nn.parallel import DistributedDataParallel

        device = next(lm.parameters()).device
        return Parallel(lm, world, "ddp", DistributedDataParallel(root, device_ids=[device.index] if device.type == "cuda" else None))
    from torch.distributed.fsdp import fully_shard

    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"distributed_strategy='fsdp2' shards a decoder by its layers, and {type(decoder).__name__} "
                         f"has no .layers; use distributed_strategy='ddp'")
    for layer in layers:
        fully_shard(layer)
    fully_shard(root)
    # FSDP2 takes the first unit whose forward runs as the root; the HF engine's sampling runs a
    # layer first (inside gathered()), so settle it on the root now
    settle_fsdp_root(root)
    return Parallel(lm, world, "fsdp2", root)

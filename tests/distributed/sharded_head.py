"""Run by torchrun (tests/distributed/test_sharded_head.py): the fused loss's gradients under DDP and
FSDP2 on gloo ranks, each rank half of a batch, against one process on the whole batch. The loss
reads the lm_head weight through `policy_parts`, as the trainer's step does. Rank 0 prints one JSON
line: case -> worst relative gradient difference, or the error raised."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from grpo_fast import fused_linear_logprobs
from grpo_fast.train.forward import policy_parts
from tests.tiny_model import load_tiny_model


class Hidden(torch.nn.Module):
    """The causal LM as the wrapped module; its forward ends at the decoder's hidden states."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return policy_parts(self.lm)[0](input_ids=ids).last_hidden_state


def loss(forward, lm, ids, total):
    hidden = forward(ids[:, :-1])
    _, weight, _ = policy_parts(lm)
    return -fused_linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, ids[:, 1:].reshape(-1)).sum() / total


def untied(lm):
    lm.config.tie_word_embeddings = False
    lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach().clone() * 1.1)
    return lm


def case(model_dir, tie, wrap, ids, rank, world):
    ref, lm = (load_tiny_model(model_dir)[0] for _ in range(2))
    if not tie:
        ref, lm = untied(ref), untied(lm)
        lm.lm_head.weight.data.copy_(ref.lm_head.weight)
    loss(Hidden(ref), ref, ids, ids.numel()).backward()  # one process, the whole batch
    module = Hidden(lm)
    if wrap == "ddp":
        forward = DistributedDataParallel(module)
    else:
        if wrap == "fsdp2_head_unit":
            fully_shard(lm.lm_head)
        for layer in lm.model.layers:
            fully_shard(layer)
        forward = fully_shard(module, reshard_after_forward=wrap == "fsdp2_resharded_root")
    mine = ids[rank * 2 : (rank + 1) * 2]
    try:
        loss(forward, lm, mine, ids.numel()).backward()
    except RuntimeError as err:
        return str(err).split(":")[0]
    worst = 0.0
    for p, q in zip(lm.parameters(), ref.parameters(), strict=True):
        grad = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) * world  # the wrappers average
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return worst


def main(model_dir):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ids = torch.randint(3, 200, (2 * world, 12), generator=torch.Generator().manual_seed(1))
    seen = {}
    for tie, wrap in [(True, "ddp"), (False, "ddp"), (True, "fsdp2"), (False, "fsdp2_head_unit"),
                      (True, "fsdp2_resharded_root")]:
        seen[f"{wrap}, {'tied' if tie else 'untied'}"] = case(model_dir, tie, wrap, ids, rank, world)
    if rank == 0:
        print(json.dumps(seen), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

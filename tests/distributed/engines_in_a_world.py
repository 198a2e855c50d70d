"""Run by torchrun (tests/distributed/test_engines_in_a_world.py): one in-process vLLM engine per rank
inside a world of gloo processes. Each rank checks, and rank 0 prints one JSON line of what it saw."""

import json
import sys

import torch
import torch.distributed as dist

from grpo_fast.rollout import VLLMEngine

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41, 42, 43, 44]]
SEEDS = [101, 102, 103, 104]


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, seed=rank)  # engine seeds differ per rank
    share = len(PROMPTS) // world  # this rank's prompts, each with its own seed
    mine = slice(rank * share, (rank + 1) * share)
    groups = engine.generate(PROMPTS[mine], n=2, max_new_tokens=6, temperature=1.0, seed=SEEDS[mine])
    gathered = [None] * world
    dist.all_gather_object(gathered, [[c.token_ids for c in g] for g in groups])
    whole = engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=SEEDS)  # what one rank samples
    engine.close()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the default group outlives the engine
    if rank == 0:
        print(json.dumps({"world": world, "split_equals_whole": [g for part in gathered for g in part]
                          == [[c.token_ids for c in g] for g in whole], "all_reduce": total.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

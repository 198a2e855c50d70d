"""Run by `python -m torch.distributed.run --standalone --nproc_per_node 2` (tests/integrations/test_trl_distributed.py):
a few SGD steps of stock `trl.GRPOTrainer` or grpo_fast's `FastGRPOTrainer` (or both, one after the other)
on the tiny Llama under DDP, for each named config of CONFIGS in turn. One launch for all: starting the
processes and importing TRL take ~20 s of a launch on 2 cores, the steps of one config ~2 s.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integrations/trl_ranks.py \
        {stock|fast|stock,fast} MODEL_DIR OUTPUT_DIR CONFIG [CONFIG ...]

Why torchrun and not `accelerate launch --num_processes 2 --cpu`: on a machine without accelerators
accelerate 1.16 starts several CPU processes only through mpirun (--mpirun_hostfile); without it it
runs ONE process, and the run would silently not be distributed. Under torchrun, TRL's Accelerator
(use_cpu=True) sees LOCAL_RANK and sets up MULTI_CPU over gloo, as `accelerate launch` would have.

Rank 0 writes OUTPUT_DIR/TRAINER/CONFIG/weights.safetensors (the final parameters) and run.json (the
world as the trainer saw it, the prompts and completion token ids each rank sampled, the logged lines).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from safetensors.torch import save_file

from tests.integrations.conftest import grpo_config, length_reward

PROMPTS = ["ab", "cde", "fgh i", "jk", "lmno", "p", "qrs", "tu"]  # tests/integrations/conftest.py's `prompts`
# per rank 4 completions a micro-step, 2 micro-steps per optimizer step: each generation is 16 completions
# (4 prompts x 4) over the 2 ranks, 8 on each. SGD, not Adam: see tests/integrations/test_trl_training.py's
# docstring. No gradient clipping: the gradient norm is ~4 here, so clipping to TRL's default 1.0 would
# rescale a wrongly scaled gradient back to the right update (measured: a dapo normaliser missing the
# world size left the weights within 1e-3 of their update); lr 0.05 keeps the step ~ the clipped lr-0.2 one.
PER_RANK_GENERATION = 8
COMMON = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="sgd",
              learning_rate=0.05, max_grad_norm=0.0, lr_scheduler_type="constant", disable_tqdm=True)
CONFIGS = {
    # TRL's default loss (dapo): the single fused pass, normalised by all ranks' tokens / world size
    "on-policy-dapo": dict(num_iterations=1, beta=0.0),
    # per-sequence means (DDP averages them), old log-probs and the reference model: the log-prob route; with
    # the adaptive entropy bonus, whose controller reduces the entropy over the ranks (a target above the tiny
    # model's ~5 nats opens its gate from the second step, as in tests/integrations/test_trl_training.py)
    "iterations2-kl-grpo-entropy": dict(num_iterations=2, beta=0.05, loss_type="grpo", use_adaptive_entropy=True,
                                        entropy_coef=0.05, entropy_target=100.0, entropy_coef_delta=0.05),
}


def train(cls, name: str, model_dir: str, out: Path) -> None:
    seen = []

    def reward(prompts, completions, completion_ids, **kwargs):  # records what this rank sampled, then scores it
        seen.extend({"prompt": p, "completion_ids": list(ids)} for p, ids in zip(prompts, completion_ids, strict=True))
        return length_reward(completions)

    reward.__name__ = "length_reward"
    trainer = cls(model=model_dir, reward_funcs=reward, args=grpo_config(out / "trainer", **COMMON, **CONFIGS[name]),
                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()

    accelerator = trainer.accelerator
    per_rank = gather_object([seen])  # [rank 0's list, rank 1's list]
    if accelerator.is_main_process:
        save_file({n: p.detach().contiguous() for n, p in trainer.model.named_parameters()}, out / "weights.safetensors")
        run = dict(trainer=cls.__name__, num_processes=accelerator.num_processes, distributed_type=str(accelerator.distributed_type),
                   wrapper=type(trainer.model_wrapped).__name__, global_step=trainer.state.global_step,
                   entropy_coef=trainer.entropy_coef, samples=per_rank,
                   logs=[h for h in trainer.state.log_history if "loss" in h])
        (out / "run.json").write_text(json.dumps(run))
    accelerator.wait_for_everyone()


def main(which: str, model_dir: str, output_dir: str, *names: str) -> None:
    torch.set_num_threads(1)
    from trl import GRPOTrainer

    from grpo_fast.integrations.trl import FastGRPOTrainer

    trainers = {"stock": GRPOTrainer, "fast": FastGRPOTrainer}
    for key in which.split(","):  # Trainer.train() reseeds every RNG, so a run does not depend on the ones before
        for name in names:
            train(trainers[key], name, model_dir, Path(output_dir) / key / name)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Run by torchrun, or as a plain process (tests/distributed/test_trainer_ranks.py): a short GRPO run
of the tiny model with the HF engine; the global batch is per_device_train_batch_size x ranks."""

import json
import sys
from pathlib import Path

import torch

from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import load_tiny_model
from tests.trainer.common import config, rows, target_fraction


def main(model_dir: str, output_dir: str, per_device: int) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_tiny_model(model_dir)
    c = config(Path(output_dir), output_dir=output_dir, per_device_train_batch_size=per_device, eval_max_samples=4,
               save_steps=1)
    trainer = GRPOTrainer(c, [target_fraction], rows(), rows(4), model=model, tokenizer=tokenizer)
    trainer.train()
    if trainer.world.main:
        print(json.dumps({"world": trainer.world.size, "step": trainer.state.step}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

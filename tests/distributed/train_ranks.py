"""Run by torchrun, or as a plain process (tests/distributed/test_trainer_ranks.py): short GRPO runs
of the tiny model, one after another in this process (jobs separated by `+`: each starting a process
costs ~10 s of imports on the 2-core machines, so runs that start the same world share one launch):

    train_ranks.py MODEL_DIR OUT PER_DEVICE ENGINE [name=value ...] [+ OUT PER_DEVICE ENGINE ...]

ENGINE is hf, or vllm (one in-process engine per rank); `name=value` arguments override the config
(resume_from_checkpoint=..., scale_rewards=batch, distributed_strategy=fsdp2; kill_rank_after_step=R:N,
a fault for the elastic-restart test; judge_rank=hf, a judge_rank reward whose requests go to OUT/judge-rank<r>.json;
tool_model=DIR, an agents run: the tiny tool-calling model of DIR, its tools and prompts, multi-turn trajectories;
model_dir=DIR, another tiny model's folder);
the global batch is per_device_train_batch_size x ranks. Each
rank writes the completion ids it sampled, per reward call (train and eval), to OUT/sampled-rank<r>.json; rank 0
prints one JSON line per job, in order. A one-process launch may also run as `main(...)` inside a test's process."""

import json
import os
import signal
import sys
from pathlib import Path

import torch

from grpo_fast.trainer import GRPOTrainer
from tests.agents.tool_model import TOOL_NAMES, right_answer, tool_prompts
from tests.tiny_model import load_tiny_model
from tests.trainer.common import config, rows, target_fraction


def main(model_dir: str, *argv: str) -> None:
    torch.set_num_threads(1)
    jobs = [[]]
    for arg in argv:
        jobs.append([]) if arg == "+" else jobs[-1].append(arg)
    for output_dir, per_device, engine, *overrides in jobs:
        run(model_dir, output_dir, int(per_device), engine, *overrides)


def run(model_dir: str, output_dir: str, per_device: int, engine: str, *overrides: str) -> None:
    overrides = {k: {"True": True, "False": False}.get(v, v) for k, v in (o.split("=", 1) for o in overrides)}
    agents = overrides.pop("tool_model", None)
    model_dir = overrides.pop("model_dir", model_dir)  # another tiny model's folder (the MoE run's)
    if agents is not None:  # (tests/agents/test_multi_turn.py's run: the tools, longer sequences, one eval)
        model_dir = agents
        overrides = dict(tools=TOOL_NAMES, max_prompt_length=64,
                         max_completion_length=160, max_tokens_per_microbatch=2048, learning_rate=1e-4, eval_steps=2,
                         eval_before_train=False, **overrides)
    model, tokenizer = load_tiny_model(model_dir)
    kill = overrides.pop("kill_rank_after_step", None)  # "R:N": rank R kills itself after step N (first attempt only)
    judged = overrides.pop("judge_rank", None) == "hf"  # a judge_rank reward on the tiny model (HF judge engine)
    c = config(Path(output_dir), output_dir=output_dir, per_device_train_batch_size=per_device, eval_max_samples=4,
               save_steps=1, engine=engine, dtype="float32", model=model_dir, **overrides)
    if kill is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _kill_after_step(*map(int, kill.split(":")))
    sampled = []

    graded = right_answer if agents is not None else target_fraction

    def reward(prompts, completions, completion_ids, **columns):  # records what this rank sampled, then scores it
        sampled.append(completion_ids)
        return graded(prompts, completions, completion_ids, **columns)

    reward.__name__ = graded.__name__
    funcs = [reward]
    if judged:
        from grpo_fast.rewards.judge import JudgeOptions, JudgeRank

        funcs.append(JudgeRank(JudgeOptions(model=model_dir, engine="hf", max_new_tokens=24)))
    data = (tool_prompts(24), tool_prompts(4, 1)) if agents is not None else (rows(), rows(4))
    trainer = GRPOTrainer(c, funcs, *data, model=model, tokenizer=tokenizer)
    if c.use_peft and trainer.world.main:  # the adapter as it starts (what the update is measured from)
        from safetensors.torch import save_file

        from grpo_fast.models import lora

        Path(output_dir).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in lora.adapter_tensors(trainer.model).items()},
                  str(Path(output_dir) / "initial_adapter.safetensors"))
    trainer.train()
    if judged:  # what this rank's judge saw, in order
        (Path(output_dir) / f"judge-rank{trainer.world.rank}.json").write_text(json.dumps(list(funcs[1].judge.requests)))
    seen = {"world": trainer.world.size, "step": trainer.state.step, "strategy": trainer.parallel.strategy}
    if trainer.packer.amp_dtype is not None:  # (a bf16 run: the decoder did run under autocast)
        seen["autocast"] = str(trainer.packer.amp_dtype)
    if kill is not None:  # which torchrun attempt finished the run
        seen["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = trainer.world.rank
    (Path(output_dir) / f"sampled-rank{rank}.json").write_text(json.dumps(sampled))
    if engine == "vllm":  # (its memory with it: test_trainer_ranks.py runs one-process launches in its own process)
        trainer.engine.close()
    if engine == "vllm" and trainer.world.size > 1:  # closing an engine leaves the trainer's process group alive
        total = torch.tensor([1.0])
        torch.distributed.all_reduce(total)
        seen["all_reduce_after_close"] = total.item()
    if trainer.world.main:
        print(json.dumps(seen), flush=True)


def _kill_after_step(rank: int, step: int) -> None:
    """SIGKILL this process on `rank` right after optimizer step `step` (before that step's checkpoint)."""
    real = GRPOTrainer._optimizer_step

    def optimizer_step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.world.rank == rank and self.state.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    GRPOTrainer._optimizer_step = optimizer_step


if __name__ == "__main__":
    main(*sys.argv[1:])

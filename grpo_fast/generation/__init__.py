"""Generation: everything that turns prompts into completions ready to score, and nothing of training.

- `engines/`: one engine interface (`base.py`), the engine kinds as registry rows, the in-process vLLM
  engine (weights hot-swapped after each optimizer step) and the HF engine (the policy's own `generate`);
- `modes/`: the rollout modes, one file each: how a group is sampled, its advantages hook, what it supports;
- `rounds.py`: partial rollouts (`max_staleness >= 1`), one round driver whose members are completions or
  agent trajectories;
- `agents/`: tools, chat templates and the multi-turn loop (rollout_mode multi_turn);
- `batch.py`: `Rollouts`, what generation hands to scoring and training.

This package imports no training stage (`grpo_fast.train`); the generate stage (`train/generate.py`) calls it.
"""

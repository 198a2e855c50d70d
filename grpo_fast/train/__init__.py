"""The stages of a step, one module each (generate, score, advantages, logprobs, step, sync, evaluate), and
what they share: the optimizer and its schedule (optimizer.py), the loop's state (state.py), packing and the
training forward, signals, many ranks. `grpo_fast/trainer.py` runs them in order."""

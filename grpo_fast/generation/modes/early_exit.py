"""S-GRPO's serial groups (rollout_mode=early_exit): per prompt one full completion, cut at
early_exit_points positions, each cut answered after early_exit_text (sampling: generation/modes/sampling.py).
The first reward becomes the decaying serial reward of each serial group (1/2^(i-1) for its i-th
correct member, else 0), the other functions' rewards are added with their weights; advantage
r - mean(r) of that weighted sum."""

from __future__ import annotations

from . import RolloutMode, register


class EarlyExit(RolloutMode):
    name = "early_exit"
    summary = "S-GRPO: serial groups of early exits from one full completion per prompt"

    def max_sequence_completion(self, c) -> int:
        # a prefix, the injected text (bounded by its UTF-8 bytes) and the answer
        return c.max_completion_length + len(c.early_exit_text.encode()) + c.early_exit_answer_length

    def checks(self) -> tuple:
        from ...config_checks import OUTSIDE_01, Combination, first_reward

        return (
            Combination("num_generations", None, lambda c: (
                f"early_exit_points + 1 = {c.early_exit_points + 1} with rollout_mode='early_exit' (a serial group is "
                f"the early_exit_points cuts plus the full completion); set num_generations or early_exit_points to "
                f"match"),
                lambda c: c.num_generations != c.early_exit_points + 1, ""),
            Combination("early_exit_points", None, lambda c: (
                f"at most max_completion_length ({c.max_completion_length}) with rollout_mode='early_exit': a "
                f"completion of L tokens has at most L distinct cut positions, so more cuts would coincide"),
                lambda c: c.early_exit_points > c.max_completion_length, ""),
            Combination("reward_funcs", None, lambda c: (
                f"a 0/1 verifier first with rollout_mode='early_exit', not {first_reward(c)!r}: the serial reward "
                f"replaces the first function's value (its correctness is all it keeps), so {first_reward(c)!r}'s "
                f"length term would never train; S-GRPO's decay is the length term (put 'math' first, "
                f"{first_reward(c)!r} after it to add it with its weight)"),
                lambda c: first_reward(c) in OUTSIDE_01, ""),
        )

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed):
        from . import sampling as rollout_modes

        return rollout_modes.early_exit(engine, tokenizer, prompts, rows, c, seed, sampling=sampling)

    def advantages(self, batch, c, judge=None, *, prompt_column="prompt", conversational=False, world=None):
        import torch

        from ... import objective
        from ...train.advantages import correct
        from ...train.score import weighted_rewards

        G = c.num_generations
        ok = correct(batch.rewards).view(-1, G)
        serial = torch.stack([objective.decaying_serial_rewards(group) for group in ok])  # (P, m + 1)
        rewards = batch.rewards.clone()
        rewards[:, 0] = serial.reshape(-1).double()  # the verifier's value becomes the serial reward
        batch.trained_rewards = rewards
        total = weighted_rewards(rewards, c.reward_weights).view(-1, G)  # (P, m + 1); never NaN: column 0 is known
        adv = total - total.mean(1, keepdim=True)
        first = [int(group.nonzero()[0]) if group.any() else None for group in ok]  # exit index of the first right one
        found = [f for f in first if f is not None]
        bodies = [len(ids) - (reason == "stop") for ids, reason, kind in
                  zip(batch.completion_ids, batch.finish_reason, batch.kind or ["full"] * len(batch), strict=True)
                  if kind == "full"]
        stats = {"early_exit/serial_reward_mean": serial.mean().item(),
                 "early_exit/first_correct_exit": sum(found) / len(found) if found else float("nan"),
                 # full completions shorter than early_exit_points: some of their cuts coincide (rollout_modes.py)
                 "early_exit/short_completion_frac": sum(b < c.early_exit_points for b in bodies) / max(len(bodies), 1)}
        return adv.reshape(-1).float(), stats


register(EarlyExit())

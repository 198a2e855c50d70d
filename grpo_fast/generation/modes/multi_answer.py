"""GRPO-MA's thoughts and answers (rollout_mode=multi_answer): per prompt K = num_generations thoughts,
M = answers_per_thought answers each (sampling: generation/modes/sampling.py). Answers get the group
advantage over their prompt's K x M answers, thoughts the advantage of their mean answer reward over
the prompt's K thoughts (rewards: the weighted sum of every function's)."""

from __future__ import annotations

from . import RolloutMode, register


class MultiAnswer(RolloutMode):
    name = "multi_answer"
    summary = "GRPO-MA: num_generations thoughts per prompt, answers_per_thought answers each"

    def group_size(self, c) -> int:  # K thoughts and K x M answers
        return c.num_generations * (1 + c.answers_per_thought)

    def graded_per_prompt(self, c) -> int:  # the answers are graded, not the thoughts
        return c.num_generations * c.answers_per_thought

    def max_sequence_completion(self, c) -> int:  # a thought and an answer
        return c.max_thought_length + c.max_completion_length

    def group_text(self, c) -> str:
        return f"num_generations x (1 + answers_per_thought) = {self.group_size(c)} with rollout_mode='multi_answer'"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed):
        from ...data.inputs import InputOptions, thought_end
        from . import sampling as rollout_modes

        return rollout_modes.multi_answer(engine, tokenizer, prompts, rows, c, thought_end(InputOptions.from_config(c)), seed,
                                          sampling=sampling)

    def advantages(self, batch, c, judge=None, *, prompt_column="prompt", conversational=False, world=None):
        import torch

        from ... import objective
        from ...train.score import weighted_rewards

        K, M = c.num_generations, c.answers_per_thought
        batch.trained_rewards = batch.rewards
        total = torch.nan_to_num(weighted_rewards(batch.rewards, c.reward_weights), nan=0.0).view(-1, K * (1 + M))
        thought, answer = objective.thought_answer_advantages(total[:, K:].reshape(-1, K, M))
        adv = torch.cat([thought, answer.flatten(1)], dim=1)
        return adv.reshape(-1).float(), {"multi_answer/thought_advantage_abs_mean": thought.abs().mean().item()}


register(MultiAnswer())

"""A user reward function, imported by path in test_registry ("tests.rewards.user_rewards:length_reward")."""


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [float(len(c)) for c in completions]


NOT_CALLABLE = 3

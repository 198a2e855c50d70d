"""GRPO's parallel groups: num_generations independent completions per prompt; group advantages of the
(weighted) rewards, after SGPO's partial credit (groups with no correct answer: the first reward becomes
sigmoid(beta (judge score - gamma))), then GRPO-LEAD's difficulty weights and Stable GRPO's noise-aware
weights multiply them (the math: objective.py). "Correct" is the first reward function's value > 0."""

from __future__ import annotations

from . import RolloutMode, register


class Parallel(RolloutMode):
    name = "parallel"
    summary = "num_generations independent completions per prompt"
    supports_partial_rollouts = True
    shapes_parallel_groups = True
    runs_on_many_ranks = True
    streams_groups = True
    carries_routing = True  # its batch is the engine's completions as they came (from_engine)
    carries_kept_sets = True  # (from_engine, and partial rollouts' members)
    takes_images = True  # (the engine processes each prompt's images once: Rollouts.image_inputs via from_engine)

    def sequence_text(self, c, longest=False) -> str:
        return "max_completion_length"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed, on_group=None, images=None):
        from ..batch import from_engine
        from ..engines.base import prompt_seeds

        extra = {"images": images} if images is not None else {}  # (an engine without images need not take the keyword)
        groups = engine.generate(prompts, n=c.num_generations, max_new_tokens=c.max_completion_length,
                                 sampling=sampling, seed=prompt_seeds(seed(), len(prompts), first), on_group=on_group,
                                 **extra)
        return from_engine(groups, prompts, rows)

    def advantages(self, batch, c, judge=None, *, world=None):
        """Statistics over the whole batch (`scale_rewards="batch"`) use every rank's rewards."""
        import torch

        from ... import objective
        from ...distributed import ONE_PROCESS, gather_rows

        world = world or ONE_PROCESS
        G, rewards, stats = c.num_generations, batch.rewards, {}
        ok = objective.correct(rewards)
        if judge is not None:
            rewards, stats = _partial_credit(batch, ok, c, judge)
        batch.trained_rewards = rewards
        mine = slice(None)
        if c.scale_rewards == "batch" and world.size > 1:  # the std over all ranks' rewards, as one process has it
            mine = slice(world.rank * len(rewards), (world.rank + 1) * len(rewards))
            rewards = gather_rows(rewards, world)
        adv = objective.group_advantages(rewards, G, scale_rewards=c.scale_rewards, std=c.advantage_std,
                                         reward_weights=c.reward_weights, aggregation=c.multi_objective_aggregation)[mine]
        rewards = rewards[mine]
        if c.difficulty_weighting:
            adv = objective.difficulty_weights(adv, ok, G, A=c.difficulty_A, B=c.difficulty_B, rho0=c.difficulty_rho0,
                                               k=c.difficulty_k)
        if c.reward_noise_rate is not None:
            first = torch.nan_to_num(rewards[:, 0], nan=0.0)
            if bool(((first < 0) | (first > 1)).any()):
                raise ValueError(f"reward_noise_rate={c.reward_noise_rate} needs the first reward function's values in "
                                 f"[0, 1] (a verifier's 0/1), got values in [{float(first.min())}, {float(first.max())}]")
            weights = objective.noise_aware_weights(first, G, p=c.reward_noise_rate)
            adv = adv * weights
            stats["noise_aware/weight_mean"] = weights.mean().item()
        return adv, stats


def _partial_credit(batch, ok, c, judge):
    """The rewards with SGPO's partial credit in the groups that have no correct answer: the judge
    runs on those completions only (judge(batch) -> [n, 1] rewards)."""
    import torch

    from ... import objective

    G = c.num_generations
    none_right = ~ok.view(-1, G).any(1)
    rows = [g * G + j for g in range(len(none_right)) if none_right[g] for j in range(G)]
    rewards = batch.rewards.clone()
    if rows:
        scores = judge(batch.select(rows))
        judged = torch.nan_to_num(scores[:, 0], nan=0.0)  # None (no reasoning to judge): no credit
        if bool(((judged < 0) | (judged > 1)).any()):
            raise ValueError(f"partial_credit_judge={c.partial_credit_judge!r}: expected scores in [0, 1], got values "
                             f"in [{float(judged.min())}, {float(judged.max())}]")
        step_scores = torch.full((len(batch),), 0.0, dtype=torch.float64)
        step_scores[rows] = judged
        credit = objective.partial_credit_rewards(rewards[:, 0].nan_to_num(0.0), ok, step_scores, G,
                                                  beta=c.partial_credit_beta, gamma=c.partial_credit_gamma)
        rewards[rows, 0] = credit[rows].double()
    return rewards, {"partial_credit/frac_groups": none_right.float().mean().item()}


register(Parallel())

"""A rollout mode is one registered object (`grpo_fast.generation.modes`). This file defines a new one, in the test
alone (one class, one `register` call), and the config accepts it, its checks refuse what it cannot
run in the same words as the built-in modes', and the trainer trains a step with it; an unknown mode
raises naming the known ones. A second one (one more class) says it supports partial rollouts, and the
trainer runs it in rounds on the vLLM engine, its groups in flight between them."""

from __future__ import annotations

import pytest
import torch

from grpo_fast.generation.modes import ROLLOUT_MODES, RolloutMode, register, rollout_mode, unregister


class LeaveOneOut(RolloutMode):
    """RLOO: num_generations independent completions per prompt, each one's advantage its reward minus
    the mean of the group's others."""

    name = "leave_one_out"
    summary = "num_generations completions per prompt, baseline the mean of the others"

    def sample(self, engine, tokenizer, prompts, rows, first, c, sampling, seed):
        from grpo_fast.generation.batch import from_engine
        from grpo_fast.generation.engines.base import prompt_seeds

        groups = engine.generate(prompts, n=c.num_generations, max_new_tokens=c.max_completion_length,
                                 sampling=sampling, seed=prompt_seeds(seed(), len(prompts), first))
        return from_engine(groups, prompts, rows)

    def advantages(self, batch, c, judge=None, *, prompt_column="prompt", conversational=False, world=None):
        from grpo_fast.objective import weighted_rewards

        G = c.num_generations
        batch.trained_rewards = batch.rewards
        total = torch.nan_to_num(weighted_rewards(batch.rewards, c.reward_weights), nan=0.0).view(-1, G)  # (P, G)
        baseline = (total.sum(1, keepdim=True) - total) / (G - 1)
        return (total - baseline).reshape(-1).float(), {"leave_one_out/baseline_mean": baseline.mean().item()}


class LeaveOneOutInRounds(LeaveOneOut):
    """The same, also in rounds of partial rollouts (its round members: plain completions, `RolloutMode.round_members`)."""

    name = "leave_one_out_in_rounds"
    supports_partial_rollouts = True


@pytest.fixture
def new_mode():
    mode = register(LeaveOneOut())
    yield mode.name
    unregister(mode.name)


def test_the_built_in_modes_are_the_registry():
    assert list(ROLLOUT_MODES) == ["parallel", "early_exit", "multi_answer", "multi_turn"]


def test_the_config_takes_a_new_mode_and_its_checks_read_what_it_supports(new_mode, tmp_path):
    from tests.trainer.common import config

    c = config(tmp_path, rollout_mode=new_mode)
    assert c.group_size == 4 and c.max_sequence_completion == 8
    with pytest.raises(ValueError, match=r"dynamic_sampling=True is invalid: expected False with "
                                         r"rollout_mode='leave_one_out': it shapes the advantages of parallel groups"):
        config(tmp_path, rollout_mode=new_mode, dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"rollout_mode='leave_one_out' is invalid: expected 'parallel' or "
                                         r"'multi_turn' with max_staleness=1"):
        config(tmp_path, rollout_mode=new_mode, max_staleness=1, engine="vllm")


def test_the_trainer_trains_a_step_with_a_new_rollout_mode(new_mode, tmp_path, tiny):
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    c = config(tmp_path, rollout_mode=new_mode, max_steps=1, save_final=False, eval_before_train=False)
    last = GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    assert last["grad_norm"] > 0 and "leave_one_out/baseline_mean" in last, last


def test_an_unknown_rollout_mode_raises_naming_the_known_ones(tmp_path):
    from tests.trainer.common import config

    with pytest.raises(ValueError, match=r"rollout_mode='leave_one_out'.*'parallel'.*'early_exit'.*'multi_answer'.*'multi_turn'"):
        config(tmp_path, rollout_mode="leave_one_out")
    with pytest.raises(ValueError, match=r"rollout_mode='nope' is not supported; expected one of \['parallel', "
                                         r"'early_exit', 'multi_answer', 'multi_turn'\]"):
        rollout_mode("nope")


@pytest.mark.slow
def test_a_new_mode_that_supports_partial_rollouts_trains_rounds_with_groups_in_flight(tmp_path, tiny_path, monkeypatch):
    import shutil

    from transformers import GenerationConfig

    from grpo_fast.generation.engines import vllm_available
    from grpo_fast.train import generate
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    if not vllm_available():
        pytest.skip("vllm is not installed")
    seen, scored_round = [], generate.scored_round  # per round: (groups in flight after it, members carried into it)

    def recorded(engine, tokenizer, data, state, *args):
        out = scored_round(engine, tokenizer, data, state, *args)
        seen.append((len(state.in_flight), out[1]["rollout/carried_over"]))
        return out

    monkeypatch.setattr(generate, "scored_round", recorded)
    model = shutil.copytree(tiny_path, tmp_path / "model")  # (vLLM stops on its generation config's eos ids: a third
    stops = GenerationConfig.from_pretrained(model)           # of the vocabulary ends a completion, so groups complete
    stops.eos_token_id = [2, *range(200, 320)]                # at different steps and a round ends with some running)
    stops.save_pretrained(model)
    mode = register(LeaveOneOutInRounds())
    try:
        c = config(tmp_path, model=str(model), rollout_mode=mode.name, engine="vllm", max_staleness=1,
                   rollout_overprovision=1.0, per_device_train_batch_size=8, max_completion_length=24, save_final=False,
                   eval_before_train=False)
        trainer = GRPOTrainer(c, [target_fraction], rows())
        try:
            last = trainer.train()
        finally:
            trainer.engine.close()
    finally:
        unregister(mode.name)
    assert len(seen) == 2 and seen[0][0] > 0 and seen[1][1] > 0, seen  # in flight after round 1, carried into round 2
    assert last["rollout/carried_over"] == seen[1][1] and "leave_one_out/baseline_mean" in last, last

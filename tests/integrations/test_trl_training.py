"""A few real training steps, stock trl.GRPOTrainer and FastGRPOTrainer side by side, end with the
same weights, the same sampled completions and the same logged metrics.

Why they sample the same completions: Trainer.train() seeds every RNG with args.seed, and neither
loss path consumes random numbers, so the k-th generation draws the same uniforms in both runs; with
weights equal to ~1e-7 the sampled tokens agree (a flip would need a draw within ~1e-7 of a
cumulative-probability boundary). The test records the completions and checks this rather than
assuming it. SGD, not Adam: Adam divides by sqrt(v) + 1e-8, which turns fp32 rounding in
near-zero gradient entries into updates of order lr, so weights would differ for reasons unrelated
to the loss; with SGD a weight difference is lr times a gradient difference.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_close

from .conftest import grpo_config, length_reward

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

LOGGED = ("loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_max", "reward",
          "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss", "entropy_coef")
# the adaptive entropy bonus: a target above the tiny model's entropy (~5 nats) opens the gate from the second step
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0, entropy_coef_delta=0.05)


def _train(cls, tiny_path, prompts, out, **config):
    seen = []

    def reward(completions, **kwargs):  # records what was sampled, then scores it
        seen.extend(completions)
        return length_reward(completions)

    reward.__name__ = "length_reward"
    args = grpo_config(out, max_steps=3, per_device_train_batch_size=4, optim="sgd", learning_rate=0.2, gradient_accumulation_steps=2,
                       lr_scheduler_type="constant", **config)
    trainer = cls(model=tiny_path, reward_funcs=reward, args=args, train_dataset=prompts)
    trainer.train()
    return trainer, seen


@pytest.mark.parametrize("config", [
    dict(num_iterations=1, beta=0.0),  # on-policy: the single fused loss pass
    dict(num_iterations=2, beta=0.05),  # old log-probs, reference, bias-corrected KL: the log-prob route
    dict(num_iterations=2, beta=0.0, loss_type="cispo", epsilon_high=1.05),
    dict(num_iterations=2, beta=0.05, loss_type="sapo"),
    dict(num_iterations=2, beta=0.0, loss_type="vespo"),
    dict(num_iterations=2, beta=0.0, loss_type="luspo", importance_sampling_level="sequence"),
    dict(num_iterations=1, beta=0.0, entropy_coef=0.05),  # static bonus, on-policy: its gradient from the fused pass
    dict(num_iterations=2, beta=0.0, loss_type="grpo", **ADAPTIVE),
], ids=["on-policy", "iterations2-kl", "cispo", "sapo-kl", "vespo", "luspo-sequence", "entropy-bonus", "adaptive-entropy"])
def test_training_steps_match_trl(tiny_path, prompts, tmp_path, config):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).state_dict()
    stock, seen_stock = _train(GRPOTrainer, tiny_path, prompts, tmp_path / "stock", **config)
    fast, seen_fast = _train(FastGRPOTrainer, tiny_path, prompts, tmp_path / "fast", **config)

    # 3 steps x 2 accumulation micro-steps; 8 completions generated every 2 * num_iterations micro-steps
    assert len(seen_stock) == 8 * math.ceil(6 / (2 * config["num_iterations"]))
    assert seen_fast == seen_stock, "the two runs sampled different completions (see the module docstring)"
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in stock.model.named_parameters())
    assert moved > 1e-3, f"training barely moved the weights ({moved:.2g}): the comparison would prove nothing"
    for name, p_stock in stock.model.named_parameters():
        p_fast = dict(fast.model.named_parameters())[name]
        assert_close(p_fast, p_stock, atol=1e-5, rtol=1e-5, name=f"weight {name}")

    logs_stock = [h for h in stock.state.log_history if "loss" in h]
    logs_fast = [h for h in fast.state.log_history if "loss" in h]
    assert len(logs_fast) == len(logs_stock) == 3
    if config.get("use_adaptive_entropy"):
        assert fast.entropy_coef == pytest.approx(stock.entropy_coef) and fast.entropy_coef > config["entropy_coef"]
    for step, (h_fast, h_stock) in enumerate(zip(logs_fast, logs_stock, strict=True)):
        for key in LOGGED:
            assert (key in h_fast) == (key in h_stock), f"step {step}: {key} logged by one trainer only"
            if key in h_stock:
                assert_close(h_fast[key], h_stock[key], atol=1e-5, rtol=1e-4, name=f"step {step} {key}")


def test_adaptive_entropy_bonus_changes_the_update(tiny_path, prompts, tmp_path):
    """With the gate open (entropy_target above the model's entropy) the bonus moves the weights away
    from the run without it: the fused entropy gradient is applied, not only logged."""
    plain, _ = _train(FastGRPOTrainer, tiny_path, prompts, tmp_path / "plain", num_iterations=2, beta=0.0, loss_type="grpo")
    bonus, _ = _train(FastGRPOTrainer, tiny_path, prompts, tmp_path / "bonus", num_iterations=2, beta=0.0,
                      loss_type="grpo", **ADAPTIVE)
    gap = max((p.detach() - dict(plain.model.named_parameters())[n].detach()).abs().max().item()
              for n, p in bonus.model.named_parameters())
    assert gap > 1e-4, f"the entropy bonus did not change the update (max weight gap {gap:.2g})"

"""TRL's MoE router load-balancing loss through the fused backend: stock trl.GRPOTrainer and FastGRPOTrainer on a
tiny random Qwen3-MoE, same seed, one optimizer step of two accumulation micro-steps, log the same aux_loss and
loss and end with the same weights (SGD: a weight gap is lr times a gradient gap; tests/integrations/
test_trl_training.py says why the two runs sample the same completions)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import assert_close, scaled

from .conftest import grpo_config, length_reward

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

COEF = 0.5  # TRL's router_aux_loss_coef, large enough that the router loss moves the weights visibly


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """A folder with the tiny random Qwen3-MoE of tests/models/test_moe.py and the tiny byte-level tokenizer."""
    from tests.models.test_moe import tiny_moe
    from tests.tiny_model import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tiny_moe("qwen3_moe").save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runs(moe_path, prompts, tmp_path_factory):
    """{cls: (trainer, weights before)} after one step of each trainer."""
    out = {}
    for cls in (GRPOTrainer, FastGRPOTrainer):
        args = grpo_config(tmp_path_factory.mktemp(cls.__name__), max_steps=1, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
                           router_aux_loss_coef=COEF)
        trainer = cls(model=moe_path, reward_funcs=length_reward, args=args, train_dataset=prompts)
        before = copy.deepcopy(trainer.model.state_dict())
        trainer.train()
        out[cls] = trainer, before
    return out


def test_router_loss_step_matches_stock_trl(runs):
    (stock, before), (fast, _) = runs[GRPOTrainer], runs[FastGRPOTrainer]
    assert fast.aux_loss_enabled and fast.router_aux_loss_coef == COEF
    logs = {cls: [h for h in trainer.state.log_history if "loss" in h] for cls, (trainer, _) in runs.items()}
    (h_stock,), (h_fast,) = logs[GRPOTrainer], logs[FastGRPOTrainer]
    assert h_stock["aux_loss"] > 1.0  # (2 for a uniform top-2 routing)
    for key in ("aux_loss", "loss", "entropy"):
        assert_close(h_fast[key], h_stock[key], atol=scaled(1e-6, h_stock[key]), rtol=1e-5, name=key)
    fast_weights = dict(fast.model.named_parameters())
    router_moved = 0.0
    for name, p_stock in stock.model.named_parameters():
        delta = p_stock.detach() - before[name]
        assert_close(fast_weights[name].detach() - before[name], delta, atol=scaled(1e-6, delta), rtol=1e-4,
                     name=f"update of {name}")
        if name.endswith("mlp.gate.weight"):
            router_moved = max(router_moved, float(delta.abs().max()))
    assert router_moved > 1e-3, "the routers barely moved: the comparison would not see a dropped router loss"


def test_get_per_token_logps_returns_trls_aux_loss(runs, moe_path):
    """compute_aux_loss=True (the method contract): the mean over row chunks of the model's own aux_loss."""
    from transformers import AutoModelForCausalLM

    fast, _ = runs[FastGRPOTrainer]
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    ids = torch.randint(3, 300, (4, 7), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # a left-padded prompt
    attention[3, 5:] = 0  # a right-padded completion
    _, _, aux = fast._get_per_token_logps_and_entropies(model, ids, attention, 3, batch_size=2, compute_aux_loss=True)
    expected = torch.stack([model(input_ids=ids[i:i + 2], attention_mask=attention[i:i + 2],
                                  output_router_logits=True).aux_loss for i in (0, 2)]).mean()
    assert_close(aux, expected, atol=scaled(1e-6, expected), rtol=1e-5, name="aux_loss")

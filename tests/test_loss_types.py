"""A loss type is one row of `grpo_fast.loss_types` plus its surrogate. This file defines a new one, in the
test alone, and the spec, the fused ops, the trainer's micro-batch accumulation, the trainer and the TRL
adapter all compute it; an unknown loss type raises everywhere, naming the known ones."""

from __future__ import annotations

import types

import pytest
import torch

from grpo_fast import objective
from grpo_fast.loss_types import LOSS_TYPES, SEQUENCE_MEAN, LossType, register, unregister
from grpo_fast.objective import LossOptions
from grpo_fast.ops import fused_linear_grpo_loss
from tests.helpers import assert_close, scaled


def capped_reinforce(ratio, t):
    """REINFORCE with the ratio capped at 1 + epsilon_high and stopped (no clip region)."""
    return -torch.clamp(ratio, max=1 + t.options.clip_range[1]).detach() * t.advantages * t.logp


def capped_metrics(ratio, t, masked_mean):
    return {"capped_reinforce/capped_mean": masked_mean(ratio > 1 + t.options.clip_range[1])}


ROW = LossType("capped_reinforce", capped_reinforce, SEQUENCE_MEAN, capped_metrics, ("capped_reinforce/capped_mean",),
               summary="REINFORCE with a capped, stopped ratio; grpo's sequence mean")


@pytest.fixture
def new_type():
    register(ROW)
    yield ROW.name
    unregister(ROW.name)


def _inputs(seed=0, B=3, T=5, H=16, V=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_(True)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():  # old log-probs near the current ones: ratios on both sides of the cap
        logp, _ = objective.token_logprobs(hidden @ weight.T, target)
        old = logp + 0.3 * torch.randn(B, T, generator=g)
    return hidden, weight, target, advantages, mask, old


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_fused_op_computes_a_new_loss_type_like_the_spec(new_type, backend):
    hidden, weight, target, advantages, mask, old = _inputs()
    options = LossOptions(loss_type=new_type, beta=0.05, epsilon_high=0.1, backend=backend)
    ref_logp = old - 0.1
    loss, metrics = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, old_logp=old, ref_logp=ref_logp,
                                           options=options)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_loss, ref_metrics = objective.grpo_loss_reference(hidden @ weight.T, target, advantages, mask, options,
                                                          old_logp=old, ref_logp=ref_logp)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    assert set(metrics) == set(ref_metrics) == {"kl", "entropy", "capped_reinforce/capped_mean", "policy_loss"}
    assert 0 < ref_metrics["capped_reinforce/capped_mean"] < 1, "the cap should bind on some tokens only"
    assert_close(loss, ref_loss, atol=scaled(1e-6, ref_loss), rtol=1e-5, name="loss")
    for name in metrics:
        assert_close(metrics[name], ref_metrics[name], atol=scaled(1e-6, ref_metrics[name]), rtol=1e-5, name=name)
    for name, g, r in zip(("hidden", "weight"), grads, ref_grads, strict=True):
        assert_close(g, r, atol=scaled(1e-6, r), rtol=1e-4, name=f"grad {name}")


def test_micro_batches_of_a_new_loss_type_add_up(new_type, tiny):
    """Its row's accumulation rule: 3 micro-batches give the gradient of one (and of the spec)."""
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.step import train_step
    from tests.trainer.test_step import CaptureGrads, _batch, _reference_grads

    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=new_type, beta=0.05, temperature=0.8, backend="cpu")
    batch = _batch(seed=3)
    expected = _reference_grads(model, batch, options)
    for budget, micro_batches in ((1000, 1), (16, 3)):
        optimizer = CaptureGrads(model)
        metrics = train_step(model, optimizer, Packer(model, max_tokens=budget), batch, options, max_grad_norm=0.0)
        assert metrics["num_micro_batches"] >= micro_batches and metrics["skipped"] == 0
        assert (metrics["num_micro_batches"] == 1) == (micro_batches == 1)
        for name, grad in expected.items():
            assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3,
                         name=f"{micro_batches} micro-batch(es): grad {name}")


def test_the_trainer_trains_a_step_with_a_new_loss_type(new_type, tmp_path, tiny):
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    c = config(tmp_path, loss_type=new_type, max_steps=1, save_final=False, eval_before_train=False)
    last = GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    assert last["grad_norm"] > 0 and "capped_reinforce/capped_mean" in last, last


def test_the_trl_adapter_computes_a_new_loss_type_like_the_spec(new_type, tiny_path, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset

    from grpo_fast.integrations.trl import FastGRPOTrainer
    from tests.integrations.conftest import grpo_config, length_reward

    prompts = Dataset.from_dict({"prompt": ["ab", "cde", "fgh i", "jk"]})
    trainer = FastGRPOTrainer(model=tiny_path, reward_funcs=length_reward, train_dataset=prompts,
                              args=grpo_config(tmp_path, loss_type=new_type, per_device_train_batch_size=4))
    torch.manual_seed(0)
    trainer.model.train()
    inputs = trainer._prepare_inputs([prompts[0]] * 4)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, inputs["prompt_ids"].size(1) - 1:-1]
    options = LossOptions(loss_type=new_type, epsilon_low=0.2, epsilon_high=0.28,
                          temperature=trainer.temperature)
    expected, _ = objective.grpo_loss_reference(logits, inputs["completion_ids"], inputs["advantages"],
                                                inputs["completion_mask"], options)
    assert_close(loss, expected, atol=scaled(1e-5, expected), rtol=1e-4, name="TRL adapter loss")
    assert trainer._metrics["train"]["capped_reinforce/capped_mean"], "the row's metric is logged as TRL logs them"


def test_an_unknown_loss_type_raises_everywhere_naming_the_known_ones(tiny):
    from grpo_fast.config import GRPOConfig
    from grpo_fast.integrations.trl import check_supported_args
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.step import train_step
    from tests.trainer.test_step import CaptureGrads, _batch

    known = r"expected one of \['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'vespo', 'luspo'\]"
    with pytest.raises(ValueError, match=known):
        GRPOConfig(loss_type="nope")
    with pytest.raises(ValueError, match=known):
        LossOptions(loss_type="nope")
    hidden, weight, target, advantages, mask, old = _inputs()
    with pytest.raises(ValueError, match=known):
        fused_linear_grpo_loss(hidden, weight, target, advantages, mask, loss_type="nope")
    with pytest.raises(ValueError, match=known):
        check_supported_args(types.SimpleNamespace(loss_type="nope"))
    register(ROW)  # options built while the type existed, then the type withdrawn: the step cannot fall through
    try:
        options = LossOptions(loss_type=ROW.name, backend="cpu")
    finally:
        unregister(ROW.name)
    assert ROW.name not in LOSS_TYPES
    with pytest.raises(ValueError, match=known):
        train_step(tiny[0], CaptureGrads(tiny[0]), Packer(tiny[0], max_tokens=24), _batch(), options, max_grad_norm=0.0)

"""The MoE router load-balancing loss of the fused path equals the model's own (fp32, tiny random models).

Reference: each sequence run alone through the causal LM's own forward with `output_router_logits=True`,
its `aux_loss` and its materialised logits, the GRPO loss from `objective.grpo_loss_reference`. The fused
path: `train_step` (packed micro-batches, the decoder, the fused op, `objective.load_balancing_loss`).
A packed micro-batch of several sequences equals the model's own value on the same sequences padded
(its 2-D padding mask pools them as the 1-D token mask does).
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch

from grpo_fast import objective
from grpo_fast.generation.batch import Rollouts
from grpo_fast.models import moe
from grpo_fast.objective import LossOptions
from grpo_fast.train.forward import Packer
from grpo_fast.train.step import train_step
from tests.helpers import assert_close, scaled

VOCAB = 320  # tests/tiny_model.py's tokenizer
COEF = 0.5  # large enough that a dropped router loss moves the gradients far beyond the tolerances
OPTIONS = LossOptions(loss_type="dapo", beta=0.0, temperature=0.9, backend="cpu")


def tiny_moe_config(family: str):
    """A tiny random config of `family` (4 experts, top-2, 2 layers, hidden 32), eager-free where it can."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, num_experts_per_tok=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=32, head_dim=16)
    if family == "gpt_oss":  # attention sinks: packed rows take the dense block mask
        return transformers.GptOssConfig(**common, num_local_experts=4, head_dim=16, sliding_window=64,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=4)
    if family == "glm4_moe":  # sigmoid routing, no router loss
        return transformers.Glm4MoeConfig(**common, n_routed_experts=4, moe_intermediate_size=32, n_group=1,
                                          topk_group=1, first_k_dense_replace=0, head_dim=16)
    raise ValueError(family)


def tiny_moe(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_moe_config(family)).float()
    return model.train()


@pytest.fixture(scope="module")
def models():
    """One tiny model per family, built once for the module (each test works on a deepcopy)."""
    return {family: tiny_moe(family) for family in ("qwen3_moe", "gpt_oss", "olmoe", "glm4_moe")}


class CaptureGrads:
    """An optimizer stand-in that keeps the gradients train_step hands it."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _batch(lengths, seed=0):
    """Rollouts of (prompt, completion) pairs whose packed rows have `lengths` tokens (prompt + completion - 1)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for n in lengths:
        p = int(torch.randint(2, n - 1, (1,), generator=g))
        prompts.append(torch.randint(3, VOCAB, (p,), generator=g).tolist())
        completions.append(torch.randint(3, VOCAB, (n + 1 - p,), generator=g).tolist())
    batch = Rollouts(prompts, completions, [torch.zeros(len(c)) for c in completions], ["stop"] * len(lengths),
                     [""] * len(lengths), [{}] * len(lengths))
    batch.advantages = torch.randn(len(lengths), generator=g)
    return batch


def _reference(model, batch, groups, coef):
    """(loss, mean router loss, grads): the GRPO loss from each sequence's own materialised logits plus
    coef x the mean over `groups` (the micro-batches' sample indices) of the model's own aux_loss on
    that group's sequences (prompt + completion but the last token: what the fused path runs), padded."""
    model.zero_grad(set_to_none=True)
    seqs = [p + c[:-1] for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    width = max(len(c) for c in batch.completion_ids)
    chosen = torch.zeros(len(seqs), width, VOCAB)
    target = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    rows = []
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        logits = model(input_ids=torch.tensor([seqs[i]])).logits[0]
        rows.append(torch.cat([logits[len(p) - 1:], logits.new_zeros(width - len(c), VOCAB)]))
        target[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1.0
    chosen = torch.stack(rows)
    loss, _ = objective.grpo_loss_reference(chosen, target, batch.advantages, mask, OPTIONS)
    auxes = [torch.zeros(())]  # (coef 0: the model may have no router loss)
    for group in groups if coef else ():
        longest = max(len(seqs[i]) for i in group)
        ids = torch.tensor([seqs[i] + [0] * (longest - len(seqs[i])) for i in group])
        attention = torch.tensor([[1] * len(seqs[i]) + [0] * (longest - len(seqs[i])) for i in group])
        auxes.append(model(input_ids=ids, attention_mask=attention, output_router_logits=True).aux_loss)
    aux = torch.stack(auxes[1:] or auxes).mean()
    total = loss + coef * aux
    total.backward()
    return float(total.detach()), float(aux.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                                        if p.grad is not None}


def _fused(model, batch, max_tokens, coef, **kwargs):
    optimizer = CaptureGrads(model)
    packer = Packer(model, max_tokens=max_tokens)
    groups = [mb.rows for mb in packer.micro_batches(batch.prompt_ids, batch.completion_ids)]
    metrics = train_step(model, optimizer, packer, batch, OPTIONS, max_grad_norm=0.0, router_aux_loss_coef=coef, **kwargs)
    return metrics, optimizer.grads, groups


def _assert_equal_to_reference(model, batch, metrics, grads, groups, coef, what):
    loss, aux, expected = _reference(model, batch, groups, coef)
    assert_close(metrics["aux_loss"], aux, atol=scaled(1e-6, aux), rtol=1e-5, name=f"{what} aux_loss")
    assert_close(metrics["loss"], loss, atol=scaled(1e-6, loss), rtol=1e-5, name=f"{what} loss")
    for name, grad in expected.items():
        assert_close(grads[name], grad, atol=scaled(2e-6, grad), rtol=1e-4, name=f"{what} grad {name}")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmoe"])
def test_fused_loss_router_loss_and_gradients_equal_the_models_own(models, family):
    """One sequence per micro-batch (each alone: max_tokens below two of them), three micro-batches."""
    model = copy.deepcopy(models[family])
    batch = _batch([9, 11, 12])
    metrics, grads, groups = _fused(model, batch, max_tokens=12, coef=COEF)
    assert [len(g) for g in groups] == [1, 1, 1] and metrics["num_micro_batches"] == 3
    _assert_equal_to_reference(model, batch, metrics, grads, groups, COEF, family)
    assert 1.0 <= metrics["moe/max_expert_load"] <= 4 / 2
    # the router loss moves the routers' gradients far beyond the tolerances: a path that dropped it fails above
    plain = _reference(model, batch, groups, 0.0)[2]
    routers = [n for n in grads if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert len(routers) == 2, f"expected a router per layer among {list(grads)}"
    assert min((grads[n] - plain[n]).abs().max().item() for n in routers) > 1e-3


def test_packed_micro_batches_pool_their_sequences_as_the_models_padding_mask(models):
    """Gradient accumulation: two sequences a packed row, two micro-batches; each micro-batch's router loss is the
    model's own on its two sequences padded, and the step's is their mean (TRL's / accumulation steps)."""
    model = copy.deepcopy(models["qwen3_moe"])
    batch = _batch([9, 11, 10, 12], seed=1)
    metrics, grads, groups = _fused(model, batch, max_tokens=23, coef=COEF)
    assert sorted(len(g) for g in groups) == [2, 2]
    _assert_equal_to_reference(model, batch, metrics, grads, groups, COEF, "packed")


def test_lora_adapter_gets_the_router_loss_gradient(models):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(models["qwen3_moe"]), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    batch = _batch([9, 11, 12], seed=2)
    metrics, grads, groups = _fused(model, batch, max_tokens=12, coef=COEF)
    assert grads and all("lora_" in n for n in grads)
    _assert_equal_to_reference(model, batch, metrics, grads, groups, COEF, "lora")


def test_coefficient_follows_trl(models):
    """None: the config's (Qwen3-MoE 0.001, OLMoE 0.01); 0: off (no aux_loss logged); a dense model refuses one;
    GLM4-MoE declares none: trains without, and refuses one set (its loss is not the Switch loss)."""
    from transformers import LlamaConfig

    assert moe.router_loss(models["qwen3_moe"], None) == moe.RouterLoss(0.001, 4, 2)
    assert moe.router_loss(models["olmoe"], None).coef == 0.01
    assert moe.router_loss(models["qwen3_moe"], 0.0) is None
    assert moe.router_aux_loss_coef(LlamaConfig(), None) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 but model .llama. is not a mixture-of-experts"):
        moe.router_aux_loss_coef(LlamaConfig(), 0.1)
    assert moe.router_loss(models["glm4_moe"], None) is None
    with pytest.raises(ValueError, match="model type 'glm4_moe' is not the Switch loss"):
        moe.router_loss(models["glm4_moe"], 0.1)


def test_glm4_moe_trains_without_a_router_loss(models):
    model = copy.deepcopy(models["glm4_moe"])
    batch = _batch([9, 11], seed=3)
    metrics, grads, groups = _fused(model, batch, max_tokens=24, coef=None)
    assert "aux_loss" not in metrics and "moe/max_expert_load" not in metrics
    loss, _, expected = _reference(model, batch, groups, 0.0)
    assert_close(metrics["loss"], loss, atol=scaled(1e-6, loss), rtol=1e-5, name="glm4_moe loss")
    for name, grad in expected.items():
        assert_close(grads[name], grad, atol=scaled(2e-6, grad), rtol=1e-4, name=f"glm4_moe grad {name}")


def test_switch_loss_families_compute_the_same_function_as_installed():
    """Every model type in moe.SWITCH_LOSS_MODEL_TYPES computes its router loss with transformers'
    load_balancing_loss_func, source for source Qwen3-MoE's (whose values the tests above compare), called
    with (router logits, num_experts, num_experts_per_tok, attention_mask): a transformers release that
    changes one fails here."""
    import importlib

    reference = inspect.getsource(importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
                                  .load_balancing_loss_func)
    call = re.compile(r"load_balancing_loss_func\(\s*outputs\.router_logits,\s*self\.num_experts,\s*"
                      r"self\.num_experts_per_tok,\s*attention_mask,?\s*\)")
    for model_type in moe.SWITCH_LOSS_MODEL_TYPES:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        assert inspect.getsource(module.load_balancing_loss_func) == reference, f"{model_type}: another definition"
        assert call.search(inspect.getsource(module)), f"{model_type}: called with other arguments"


def test_load_balancing_loss_checks_its_inputs():
    logits = [torch.zeros(5, 4)]
    with pytest.raises(ValueError, match=r"expected every layer's as \[tokens, 3\]"):
        objective.load_balancing_loss(logits, 3, 2)
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[5\]"):
        objective.load_balancing_loss(logits, 4, 2, torch.ones(2, 3))
    with pytest.raises(ValueError, match="top_k must be in"):
        objective.load_balancing_loss(logits, 4, 5)
    uniform = objective.load_balancing_loss([torch.zeros(6, 4)], 4, 1)  # ties: all to one expert, uniform probabilities
    assert float(uniform) == pytest.approx(1.0)


def test_native_trainer_trains_a_step_and_logs_the_router_loss(models, tmp_path):
    """GRPOTrainer end to end (HF engine) on the tiny Qwen3-MoE: one step, TRL's aux_loss and the experts' load logged."""
    import json

    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_model import build_tiny_tokenizer
    from tests.trainer.common import config, rows, target_fraction

    model = copy.deepcopy(models["qwen3_moe"])
    c = config(tmp_path, max_steps=1, eval_before_train=False, save_final=False, router_aux_loss_coef=COEF,
               per_device_train_batch_size=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    GRPOTrainer(c, [target_fraction], rows(8), model=model, tokenizer=build_tiny_tokenizer()).train()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        (record,) = [r for r in map(json.loads, f) if "reward" in r]
    assert record["aux_loss"] > 0 and 1.0 <= record["moe/max_expert_load"] <= 2.0
    routers = [n for n in before if n.endswith("mlp.gate.weight")]
    assert all(not torch.equal(before[n], dict(model.named_parameters())[n]) for n in routers)


def test_native_trainer_refuses_a_router_loss_for_a_dense_model(tmp_path):
    """Before the engine starts or anything trains: TRL's refusal, from the model passed in."""
    from transformers import LlamaForCausalLM

    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_model import build_tiny_tokenizer, tiny_llama_config
    from tests.trainer.common import config, rows, target_fraction

    model = LlamaForCausalLM(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.1 but model \(llama\) is not a mixture-of-experts"):
        GRPOTrainer(config(tmp_path, router_aux_loss_coef=0.1), [target_fraction], rows(8), model=model,
                    tokenizer=build_tiny_tokenizer())

"""The model's own logit map inside the fused ops, against the model's own logits.

Each field TRL 1.16's fused lm_head reads (`models.adapter.logit_transform`) on a tiny random model of a family
that uses it: Gemma 2's `final_logit_softcapping`, Cohere 2's `logit_scale`, Falcon-H1's `lm_head_multiplier`,
Granite's `logits_scaling` (a divisor) and HyperCLOVA X's (a multiplier). The fused log-probs and their
gradients equal those of the model's forward with materialised logits (float32); for Gemma 2 and Cohere 2 the
fused GRPO loss equals the specification on those logits too. (`output_multiplier` is Muse Glimmer's, whose
causal LM transformers 5.19 does not ship: its reading is TRL's, its map the same multiplier as logit_scale.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_fast import objective
from grpo_fast.models.adapter import check_fusable, decoder_of, logit_transform, masked_logprobs, output_head
from grpo_fast.objective import LossOptions
from grpo_fast.ops import fused_linear_grpo_loss
from tests.helpers import assert_close, scaled

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64)

# family -> (its config's own fields, the logit map they make: (logit_scale, logit_softcap))
FAMILIES = {
    "gemma2": (dict(final_logit_softcapping=2.0, attn_logit_softcapping=None), (1.0, 2.0)),
    "cohere2": (dict(logit_scale=0.25, sliding_window=16), (0.25, None)),
    "falcon_h1": (dict(lm_head_multiplier=0.5, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1,
                       mamba_d_state=8, mamba_chunk_size=8), (0.5, None)),
    "granite": (dict(logits_scaling=4.0), (0.25, None)),
    "hyperclovax": (dict(logits_scaling=3.0), (3.0, None)),
}


def _model(family):
    fields, _ = FAMILIES[family]
    config = transformers.AutoConfig.for_model(family, **SMALL, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights large enough that the map bends the logits (soft-cap 2: tanh well past linear)
        output_head(model)[0].mul_(8.0)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logit_map_is_the_models_own(family):
    model = _model(family)
    assert tuple(logit_transform(model.config).values()) == FAMILIES[family][1]
    check_fusable(model)  # (no longer refused)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 7), generator=g)
    target, upstream = ids[:, 1:], torch.randn(2, 6, generator=g)
    options = LossOptions(temperature=0.7, **logit_transform(model.config))
    params = [output_head(model)[0], next(decoder_of(model).parameters())]

    logits = model(input_ids=ids).logits[:, :-1]
    ref_logp, ref_entropy = objective.token_logprobs(logits, target, 0.7)
    ref_grads = torch.autograd.grad((ref_logp * upstream).sum(), params)

    hidden = decoder_of(model)(input_ids=ids).last_hidden_state[:, :-1]
    weight, bias = output_head(model)
    logp, entropy = masked_logprobs(hidden, weight, bias, target, torch.ones_like(target), options=options)
    grads = torch.autograd.grad((logp * upstream).sum(), params)
    assert_close(logp, ref_logp, atol=scaled(1e-5, ref_logp), name=f"{family} logp")
    assert_close(entropy, ref_entropy, atol=scaled(1e-5, ref_entropy), name=f"{family} entropy")
    for name, got, exp in zip(("lm_head", "decoder"), grads, ref_grads, strict=True):
        assert_close(got, exp, atol=scaled(1e-5, exp), name=f"{family} grad {name}")
    unmapped = dataclasses.replace(options, logit_scale=1.0, logit_softcap=None)  # the test can fail: the map matters
    plain, _ = masked_logprobs(hidden, weight, bias, target, torch.ones_like(target), options=unmapped)
    assert (plain - ref_logp).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["gemma2", "cohere2"])
def test_fused_loss_on_the_models_logits(family):
    """The fused GRPO loss (β > 0, clipped ratios, entropy bonus) and its gradients against the spec on the
    model's own logits."""
    model = _model(family)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (3, 6), generator=g)
    target, mask = ids[:, 1:], (torch.rand(3, 5, generator=g) > 0.2).float()
    advantages = torch.randn(3, generator=g)
    options = LossOptions(temperature=0.9, beta=0.04, epsilon_high=0.28, entropy_coef=0.1,
                          **logit_transform(model.config))
    params = [output_head(model)[0], next(decoder_of(model).parameters())]
    with torch.no_grad():
        true_logp, _ = objective.token_logprobs(model(input_ids=ids).logits[:, :-1], target, 0.9)
    old, ref = true_logp + 0.3 * torch.randn(3, 5, generator=g), true_logp + 0.5 * torch.randn(3, 5, generator=g)

    logits = model(input_ids=ids).logits[:, :-1]
    ref_loss, _ = objective.grpo_loss_reference(logits, target, advantages, mask, dataclasses.replace(
        options, logit_scale=1.0, logit_softcap=None), old_logp=old, ref_logp=ref)  # (the model applied its map)
    ref_grads = torch.autograd.grad(ref_loss, params)
    hidden = decoder_of(model)(input_ids=ids).last_hidden_state[:, :-1]
    weight, bias = output_head(model)
    loss, _ = fused_linear_grpo_loss(hidden, weight, target, advantages, mask, old_logp=old, ref_logp=ref, bias=bias,
                                     options=options)
    grads = torch.autograd.grad(loss, params)
    assert_close(loss, ref_loss, atol=scaled(1e-5, ref_loss), name=f"{family} loss")
    for name, got, exp in zip(("lm_head", "decoder"), grads, ref_grads, strict=True):
        assert_close(got, exp, atol=scaled(1e-5, exp), name=f"{family} grad {name}")


def test_a_map_the_ops_cannot_take_is_refused_from_the_config():
    config = transformers.AutoConfig.for_model("cohere2", **SMALL, logit_scale=0.0)
    with pytest.raises(ValueError, match=r"config.logit_scale=0.0 .* positive finite"):
        logit_transform(config, "model")

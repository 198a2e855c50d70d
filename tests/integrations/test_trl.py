"""FastGRPOTrainer against stock trl.GRPOTrainer: same log-probs, loss, gradients and logged metrics
on the same prepared batch, for every supported loss type and option; unsupported options refused.

One batch is generated with TRL's own generation path (transformers generate), then both policies
get the same random perturbation: the stored old log-probs then differ from the current ones (ratios
away from 1, clipping on both sides) and the reference differs from the policy (KL > 0).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import assert_close, scaled

from .conftest import length_reward

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer, accelerate  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
ARGS_FIELDS = ("delta", "use_bias_correction_kl", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
               "entropy_coef_max", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_neg", "vespo_lambda_neg")


def _perturb(model, seed=1, scale=0.03):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _generation_batch(dataset, num_prompts=2, num_generations=4):
    """What TRL's sampler hands _prepare_inputs: each prompt row repeated num_generations times."""
    return [dataset[i] for i in range(num_prompts) for _ in range(num_generations)]


@pytest.fixture(scope="module")
def pair(tiny_path, prompts, tmp_path_factory):
    """(stock, fast, inputs): two trainers on identical perturbed policies, one generated batch."""
    from .conftest import grpo_config

    out = tmp_path_factory.mktemp("pair")
    kwargs = dict(reward_funcs=length_reward, train_dataset=prompts)
    stock = GRPOTrainer(model=tiny_path, args=grpo_config(out, beta=0.1, num_iterations=2), **kwargs)
    fast = FastGRPOTrainer(model=tiny_path, args=grpo_config(out, beta=0.1, num_iterations=2), **kwargs)
    torch.manual_seed(0)
    stock.model.train()
    inputs = stock._prepare_inputs(_generation_batch(prompts))
    assert "old_per_token_logps" in inputs and "ref_per_token_logps" in inputs
    for trainer in (stock, fast):
        _perturb(trainer.model)
        trainer.model.train()
    return stock, fast, inputs


def _loss_grads_metrics(trainer, inputs, ga_steps=2):
    trainer.current_gradient_accumulation_steps = ga_steps  # set by Trainer's loop; > 1 checks the scaling
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _configure(trainers, **attrs):
    for trainer in trainers:
        for name, value in attrs.items():
            target = trainer.args if name in ARGS_FIELDS else trainer
            setattr(target, name, value)


def _assert_same(stock, fast, inputs, expect_clipping=False):
    loss_s, grads_s, metrics_s = _loss_grads_metrics(stock, inputs)
    loss_f, grads_f, metrics_f = _loss_grads_metrics(fast, inputs)
    assert_close(loss_f, loss_s, atol=1e-6, rtol=1e-5, name="loss")
    assert grads_f.keys() == grads_s.keys()
    scale = max(g.abs().max().item() for g in grads_s.values())
    assert scale > 0, "the reference gradient is zero: the comparison would prove nothing"
    for name in grads_s:
        assert_close(grads_f[name], grads_s[name], atol=1e-5 * scale, rtol=1e-4, name=f"grad {name}")
    assert metrics_f.keys() == metrics_s.keys(), "the trainers logged different metrics"
    for key in metrics_s:
        assert_close(metrics_f[key], metrics_s[key], atol=1e-5, rtol=1e-5, name=f"metric {key}")
    if expect_clipping:
        clipped = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}.get(stock.loss_type, "clip_ratio/region_mean")
        assert clipped is None or metrics_s[clipped] > 0, "the batch clips nothing: clip metrics untested"
    return metrics_s


def test_logprob_passes_match_trl(pair):
    """Policy and reference passes: per-token log-probs and entropies as TRL computes them."""
    stock, fast, inputs = pair
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].size(1)
    for name, model_s, model_f in (("policy", stock.model, fast.model), ("ref", stock.ref_model, fast.ref_model)):
        entropy = name == "policy"  # TRL's reference head computes no entropy
        with torch.no_grad():
            lp_s, ent_s, _ = stock._get_per_token_logps_and_entropies(model_s, ids, att, T, batch_size=3, compute_entropy=entropy)
            lp_f, ent_f, _ = fast._get_per_token_logps_and_entropies(model_f, ids, att, T, batch_size=3, compute_entropy=entropy)
        assert_close(lp_f, lp_s, atol=scaled(2e-5, lp_s), name=f"{name} logps")
        if entropy:
            assert_close(ent_f, ent_s, atol=scaled(2e-5, ent_s), name=f"{name} entropies")


REGIMES = {  # name: (beta, use_bias_correction_kl, num_iterations)
    "beta0-it1": (0.0, True, 1), "beta0-it2": (0.0, True, 2),
    "kl-it1": (0.1, False, 1), "kl-it2": (0.1, False, 2),
    "biaskl-it1": (0.1, True, 1), "biaskl-it2": (0.1, True, 2),
}


# Every loss type x regime at token level; at sequence level (GSPO) the regimes where the ratio is
# not identically 1 plus the on-policy one.
CASES = [(lt, regime, "token") for lt in LOSS_TYPES for regime in REGIMES] + [
    (lt, regime, "sequence") for lt in LOSS_TYPES for regime in ("beta0-it1", "kl-it2", "biaskl-it2")]


@pytest.mark.parametrize("loss_type, regime, level", CASES)
def test_loss_grads_metrics_match_trl(pair, loss_type, regime, level):
    stock, fast, inputs = pair
    beta, bias_kl, iterations = REGIMES[regime]
    _configure((stock, fast), loss_type=loss_type, beta=beta, use_bias_correction_kl=bias_kl,
               importance_sampling_level=level, delta=None)
    if iterations == 1:  # on-policy: TRL uses old = current.detach()
        inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    metrics = _assert_same(stock, fast, inputs, expect_clipping=iterations == 2 and level == "token")
    if beta:
        assert metrics["kl"] > 0


OPTIONS = {
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02),
    "delta": dict(delta=1.3),
    "vllm_is_token": dict(use_vllm=True, vllm_importance_sampling_correction=True),
    "vllm_is_sequence": dict(use_vllm=True, vllm_importance_sampling_correction=True),
    "tool_mask": dict(),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_trl(pair, option):
    loss_type = "grpo" if list(OPTIONS).index(option) % 2 else "dapo"
    stock, fast, inputs = pair
    _configure((stock, fast), **{**dict(loss_type=loss_type, beta=0.1, use_bias_correction_kl=True,
                                        importance_sampling_level="token", delta=None), **OPTIONS[option]})
    gen = torch.Generator().manual_seed(3)
    B, T = inputs["completion_ids"].shape
    if option == "vllm_is_token":
        inputs = {**inputs, "importance_sampling_ratio": 0.5 + torch.rand(B, T, generator=gen)}
    if option == "vllm_is_sequence":
        inputs = {**inputs, "importance_sampling_ratio": 0.5 + torch.rand(B, 1, generator=gen)}
    if option == "tool_mask":
        inputs = {**inputs, "tool_mask": (torch.rand(B, T, generator=gen) > 0.3).long()}
    try:
        _assert_same(stock, fast, inputs, expect_clipping=True)
    finally:  # the trainers are shared by the module: restore TRL's defaults
        _configure((stock, fast), top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
                   vllm_importance_sampling_correction=True)


# TRL's newer loss types with their options, and the entropy bonus (static, adaptive, with TRL's token
# masks), on the log-prob route (old log-probs given) and the one-pass fused route (on-policy)
NEW_OPTIONS = {  # name: (trainer attributes, inputs: "off" old log-probs or "on"-policy, IS ratio)
    "entropy-dapo": (dict(loss_type="dapo", entropy_coef=0.05), "off", None),
    "entropy-dapo-on-policy": (dict(loss_type="dapo", entropy_coef=0.05), "on", None),
    "entropy-grpo-sequence": (dict(loss_type="grpo", entropy_coef=-0.05, importance_sampling_level="sequence"), "off", None),
    "entropy-sapo-on-policy": (dict(loss_type="sapo", entropy_coef=0.05), "on", None),
    "entropy-luspo-on-policy": (dict(loss_type="luspo", entropy_coef=0.05), "on", None),
    "entropy-cispo-top-entropy": (dict(loss_type="cispo", epsilon_high=1.05, entropy_coef=0.05,
                                       top_entropy_quantile=0.5), "off", None),
    "adaptive-entropy-bnpo": (dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=50.0,
                                   entropy_coef_delta=0.01, _last_world_entropy=0.0), "off", None),
    "adaptive-entropy-vespo-gate-closed": (dict(loss_type="vespo", use_adaptive_entropy=True, entropy_coef=0.02,
                                                entropy_target=1e-3, entropy_coef_delta=0.01), "on", None),
    "vespo-vllm-is-token": (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=True,
                                 vespo_k_neg=2.0, vespo_lambda_neg=1.5), "off", "token"),
    "sapo-vllm-is-sequence": (dict(loss_type="sapo", sapo_temperature_neg=2.0, use_vllm=True,
                                   vllm_importance_sampling_correction=True), "off", "sequence"),
    "cispo-off-policy-mask": (dict(loss_type="cispo", epsilon_high=1.05, off_policy_mask_threshold=0.02), "off", None),
    "luspo-sequence-top-entropy": (dict(loss_type="luspo", importance_sampling_level="sequence",
                                        top_entropy_quantile=0.5), "off", None),
}


@pytest.mark.parametrize("option", list(NEW_OPTIONS))
def test_trl_loss_types_and_entropy_bonus_match_trl(pair, option):
    stock, fast, inputs = pair
    attrs, policy, is_ratio = NEW_OPTIONS[option]
    enabled = attrs.get("entropy_coef", 0.0) != 0.0 or attrs.get("use_adaptive_entropy", False)
    _configure((stock, fast), **{**dict(beta=0.1, use_bias_correction_kl=True, importance_sampling_level="token",
                                        delta=None, epsilon_high=0.28, _entropy_bonus_enabled=enabled,
                                        _last_world_entropy=float("inf"), _entropy_window_stats=None), **attrs})
    if policy == "on":
        inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    mask = inputs["completion_mask"].float()
    gen = torch.Generator().manual_seed(5)
    if is_ratio == "token":  # as TRL builds it: exactly 1 where the completion has no token
        inputs = {**inputs, "importance_sampling_ratio": torch.where(mask > 0, 0.5 + torch.rand(mask.shape, generator=gen), 1.0)}
    if is_ratio == "sequence":
        inputs = {**inputs, "importance_sampling_ratio": 0.5 + torch.rand(mask.shape[0], 1, generator=gen)}
    try:
        metrics = _assert_same(stock, fast, inputs, expect_clipping=policy == "off")
        if enabled:
            assert "policy_loss" in metrics and "entropy_coef" in metrics
            assert stock.entropy_coef == pytest.approx(fast.entropy_coef, rel=1e-12)
            assert stock._last_world_entropy == pytest.approx(fast._last_world_entropy, rel=1e-5)
        if attrs.get("use_adaptive_entropy"):
            moved = attrs["entropy_coef"] + (0.01 if attrs["entropy_target"] > 1 else -0.01)
            assert fast.entropy_coef == pytest.approx(moved), "the adaptive controller did not move as TRL's"
    finally:  # the trainers are shared by the module: restore TRL's defaults
        _configure((stock, fast), loss_type="dapo", entropy_coef=0.0, use_adaptive_entropy=False, top_entropy_quantile=1.0,
                   off_policy_mask_threshold=None, use_vllm=False, _entropy_bonus_enabled=False, epsilon_high=0.28,
                   sapo_temperature_neg=1.05, vespo_k_neg=3.0, vespo_lambda_neg=2.0, entropy_target=0.2,
                   entropy_coef_delta=0.005, importance_sampling_level="token")


def test_entropy_bonus_changes_the_gradient(pair):
    """The bonus is not a no-op: with entropy_coef the fused route's gradient moves (and matches TRL's,
    above); the gradient difference is coef x the entropy's gradient."""
    stock, fast, inputs = pair
    inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    _configure((fast,), loss_type="dapo", beta=0.0, entropy_coef=0.0, _entropy_bonus_enabled=False)
    _, plain, _ = _loss_grads_metrics(fast, inputs)
    _configure((fast,), entropy_coef=0.5, _entropy_bonus_enabled=True, _last_world_entropy=float("inf"))
    try:
        _, bonus, _ = _loss_grads_metrics(fast, inputs)
    finally:
        _configure((fast,), entropy_coef=0.0, _entropy_bonus_enabled=False)
    diff = max((bonus[n] - plain[n]).abs().max().item() for n in plain)
    assert diff > 1e-3 * max(g.abs().max().item() for g in plain.values())


def test_lm_head_bias_untied(tiny_path, build):
    """An untied lm_head with a bias: the bias gets its gradient, the head its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.normal_(head.bias, std=0.5)
    head.weight.data.copy_(model.lm_head.weight.data)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    stock = build(GRPOTrainer, model=copy.deepcopy(model), num_iterations=2)
    fast = build(FastGRPOTrainer, model=copy.deepcopy(model), num_iterations=2)
    torch.manual_seed(0)
    stock.model.train()
    fast.model.train()
    inputs = stock._prepare_inputs(_generation_batch(stock.train_dataset))
    for trainer in (stock, fast):
        _perturb(trainer.model)
    _assert_same(stock, fast, inputs, expect_clipping=True)
    assert fast.model.lm_head.bias.grad.abs().sum() > 0


def test_accelerate_switches_a_built_trainer(pair, build):
    stock, fast, inputs = pair

    class MyTrainer(GRPOTrainer):
        def custom(self):
            return "kept"

    mine = build(MyTrainer, beta=0.1, num_iterations=2)
    mine.model.load_state_dict(stock.model.state_dict())
    assert accelerate(mine) is mine
    assert isinstance(mine, MyTrainer) and type(mine).__name__ == "FastMyTrainer" and mine.custom() == "kept"
    mine.model.train()
    _configure((stock, mine), loss_type="dapo", beta=0.1, importance_sampling_level="token", delta=None)
    _assert_same(stock, mine, inputs, expect_clipping=True)
    assert type(accelerate(build(GRPOTrainer))) is FastGRPOTrainer


@pytest.mark.parametrize("option, config", [
    ("delta=1.1", dict(delta=1.1)),
])
def test_unsupported_options_refused_at_construction(build, option, config):
    with pytest.raises(ValueError, match=option.split("=")[0]) as info:
        build(FastGRPOTrainer, **config)
    assert option.split("=")[-1].strip("'") in str(info.value)


@pytest.mark.parametrize("config", [dict(loss_type="cispo", epsilon_high=5.0), dict(loss_type="sapo"),
                                    dict(loss_type="vespo"), dict(loss_type="luspo", importance_sampling_level="sequence"),
                                    dict(entropy_coef=0.01), dict(use_adaptive_entropy=True)],
                         ids=["cispo", "sapo", "vespo", "luspo", "entropy_coef", "adaptive_entropy"])
def test_every_trl_loss_option_is_accepted(build, config):
    """Nothing of TRL 1.16's loss types and entropy bonus is refused any more (built and accelerated)."""
    assert isinstance(build(FastGRPOTrainer, **config), FastGRPOTrainer)
    assert type(accelerate(build(GRPOTrainer, **config))) is FastGRPOTrainer


def test_accelerate_refuses_unsupported_options(build):
    """What the fused loss would get wrong is refused before the trainer is switched."""
    trainer = build(GRPOTrainer, delta=1.1)
    with pytest.raises(ValueError, match="delta=1.1"):
        accelerate(trainer)
    assert type(trainer) is GRPOTrainer


def test_soft_capped_model_matches_trl(tiny_path, prompts, tmp_path):
    """Gemma 2 (tiny, random, soft-cap 2 so the logits bend) with β > 0 through both trainers: the same loss,
    gradients and metrics (its soft-cap applied inside the fused op)."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    from .conftest import grpo_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, final_logit_softcapping=2.0, attn_logit_softcapping=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    kwargs = dict(reward_funcs=length_reward, train_dataset=prompts)
    trainers = [cls(model=str(tmp_path / "gemma2"), args=grpo_config(tmp_path, beta=0.1, num_iterations=2), **kwargs)
                for cls in (GRPOTrainer, FastGRPOTrainer)]
    torch.manual_seed(0)
    trainers[0].model.train()
    inputs = trainers[0]._prepare_inputs(_generation_batch(prompts))
    for trainer in trainers:
        _perturb(trainer.model)
        trainer.model.train()
    _assert_same(*trainers, inputs)


def test_multimodal_inputs_refused(pair):
    _, fast, inputs = pair
    with pytest.raises(ValueError, match="pixel_values"):
        fast.compute_loss(fast.model, {**inputs, "pixel_values": torch.zeros(1, 3, 4, 4)})


def test_trl_version_checked(monkeypatch):
    from importlib import metadata

    import grpo_fast.integrations.trl as integration

    monkeypatch.setattr(metadata, "version", lambda name: "1.13.0")
    with pytest.raises(ImportError, match=r"trl>=1.14,<1.17.*found trl 1.13.0"):
        integration._check_trl_version()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ImportError, match="needs TRL"):
        integration._check_trl_version()


def test_eval_mode_loss_matches_trl(pair):
    """prediction_step's path: no grad, eval mode (no accumulation scaling), metrics under 'eval'."""
    stock, fast, inputs = pair
    _configure((stock, fast), loss_type="dapo", beta=0.1, importance_sampling_level="token", delta=None)
    losses, logged = [], []
    for trainer in (stock, fast):
        trainer.model.eval()
        trainer._metrics["eval"].clear()
        try:
            with torch.no_grad():
                losses.append(trainer.compute_loss(trainer.model, inputs))
        finally:
            trainer.model.train()
        logged.append({k: v[-1] for k, v in trainer._metrics["eval"].items()})
    assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-5, name="eval loss")
    assert logged[1].keys() == logged[0].keys()
    for key in logged[0]:
        assert_close(logged[1][key], logged[0][key], atol=1e-5, rtol=1e-5, name=f"eval metric {key}")


def test_loss_options_read_from_the_trainer(pair):
    """The options the fused loss gets are the values TRL's own _compute_loss reads."""
    from grpo_fast.integrations.trl import loss_options

    _, fast, _ = pair
    options = loss_options(fast)
    assert (options.loss_type, options.beta, options.temperature) == (fast.loss_type, fast.beta, fast.temperature)
    assert options.clip_range == (fast.args.epsilon, fast.args.epsilon_high) == (fast.epsilon_low, fast.epsilon_high)
    assert (options.delta, options.importance_sampling_level) == (fast.args.delta, fast.importance_sampling_level)
    assert (options.max_completion_length, options.backend) == (fast.args.max_completion_length, fast.fused_backend)


def test_truncated_sampling_keeps_trls_semantics_and_warns():
    """TRL 1.16 scores over the whole vocabulary whatever top_k / top_p / min_p: the backend keeps that (parity) and
    says so once; untruncated sampling says nothing."""
    import warnings
    from types import SimpleNamespace

    from grpo_fast.integrations.trl import warn_truncation

    for args in (SimpleNamespace(top_k=0, top_p=0.8, min_p=None), SimpleNamespace(top_k=20, top_p=1.0, min_p=None),
                 SimpleNamespace(top_k=0, top_p=1.0, min_p=0.1)):
        with pytest.warns(UserWarning, match="keeps TRL 1.16's semantics.*native trainer replays the kept sets"):
            warn_truncation(args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_truncation(SimpleNamespace(top_k=0, top_p=1.0, min_p=None))

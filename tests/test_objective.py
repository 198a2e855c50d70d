"""The reference objective against the worked examples and an independent float64 computation."""

import itertools
import math
import warnings

import pytest
import torch

from grpo_fast import group_advantages, grpo_loss_reference, objective
from grpo_fast.objective import LossOptions
from tests.helpers import assert_close, scaled

# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def test_worked_example_default_advantages():
    adv = group_advantages(torch.tensor([0.8, 0.3, 0.6, 0.3]), 4)
    assert_close(adv, [1.41, -0.94, 0.47, -0.94], atol=0.005, name="advantages")


def test_worked_example_dr_grpo_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3, scale_rewards="none")
    assert_close(adv, [1 / 3, -2 / 3, 1 / 3], atol=1e-4, name="advantages")


def test_sample_std_matches_torch_std_per_group():
    r = torch.tensor([0.1, 0.9, 0.4, 0.4, 1.0, 0.0, 0.5, 0.2])
    adv = group_advantages(r, 4, std="sample", eps=0.0)
    g = r.view(2, 4).double()
    expected = ((g - g.mean(1, keepdim=True)) / g.std(1, keepdim=True)).view(-1)
    assert_close(adv, expected, atol=scaled(1e-6, expected), name="advantages")


def test_batch_scaling_uses_group_mean_and_batch_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(r, 3, scale_rewards="batch", eps=0.0)
    g = r.view(2, 3).double()
    expected = ((g - g.mean(1, keepdim=True)) / r.double().std(unbiased=False)).view(-1)
    assert_close(adv, expected, atol=scaled(1e-6, expected), name="advantages")


def test_identical_rewards_give_zero_advantage():
    assert_close(group_advantages(torch.full((4,), 0.7), 4), torch.zeros(4), atol=0, name="advantages")


def test_missing_rewards_are_ignored_in_group_statistics():
    nan = float("nan")
    adv = group_advantages(torch.tensor([1.0, nan, 0.0, 1.0]), 4, scale_rewards="none")
    expected = [1 / 3, 0.0, -2 / 3, 1 / 3]
    assert_close(adv, expected, atol=scaled(1e-6, expected), name="advantages")


def test_several_reward_functions_weighted_sum_then_normalise():
    nan = float("nan")
    r = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 0.0], [nan, nan]])
    adv = group_advantages(r, 4, reward_weights=[1.0, 2.0], scale_rewards="none")
    totals = torch.tensor([2.0, 0.0, 1.0])  # nansum of weighted rewards; the last row knows nothing
    expected = torch.cat([totals - totals.mean(), torch.zeros(1)])
    assert_close(adv, expected, atol=scaled(1e-6, expected), name="advantages")


def test_normalise_then_sum():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    adv = group_advantages(r, 4, aggregation="normalize_then_sum", reward_weights=[1.0, 0.5], eps=0.0)
    each = [group_advantages(r[:, j], 4, eps=0.0) for j in range(2)]
    expected = each[0] + 0.5 * each[1]
    assert_close(adv, expected, atol=scaled(1e-6, expected), name="advantages")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_generations=1), "num_generations"),
        (dict(num_generations=3), "multiple of num_generations"),
        (dict(num_generations=4, scale_rewards="std"), "scale_rewards"),
        (dict(num_generations=4, std="biased"), "std"),
        (dict(num_generations=4, reward_weights=[1.0, 2.0]), "reward_weights"),
    ],
)
def test_advantage_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(8), **kwargs)


def test_group_of_two_warns():
    with pytest.warns(UserWarning, match="num_generations=2"):
        group_advantages(torch.tensor([1.0, 0.0]), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3)


# ---------------------------------------------------------------------------------------------
# Loss: an independent float64 computation, token by token
# ---------------------------------------------------------------------------------------------


def independent_loss(logits, target, adv, mask, old, ref, isw, *, beta, eps_low, eps_high, delta, temperature,
                     loss_type, level, max_len, bias_kl=False, entropy_coef=0.0, sapo=(1.0, 1.05),
                     vespo=(2.0, 3.0, 3.0, 2.0)):
    """Plain loops in float64, written from docs/design.md and TRL's _compute_loss without looking at
    objective.py."""
    B, T, V = logits.shape
    lp = [[None] * T for _ in range(B)]
    ent = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            z = logits[b, t] / temperature
            logp = z - torch.logsumexp(z, 0)
            lp[b][t] = logp[target[b, t]]
            ent[b][t] = -(logp.exp() * logp).sum()
    terms = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = sum(float(mask[b, t]) for t in range(T))
        seq = sum((lp[b][t] - old[b, t]) * mask[b, t] for t in range(T)) / max(n, 1.0)
        log_w_seq = sum(torch.clamp(lp[b][t] - old[b, t], -20, 20) * mask[b, t] for t in range(T)).detach()
        log_w_seq = torch.clamp(log_w_seq, math.log(1e-8), 20.0)
        for t in range(T):
            a = adv[b, t] if adv.dim() == 2 else adv[b]
            w = torch.exp(seq if level == "sequence" else lp[b][t] - old[b, t])
            raw_w = w
            if loss_type == "cispo":
                tok_loss = -torch.clamp(w, max=eps_high).detach() * a * lp[b][t]
            elif loss_type == "sapo":
                tau = sapo[0] if a > 0 else sapo[1]
                tok_loss = -torch.sigmoid(tau * (w - 1)) * 4 / tau * a
            elif loss_type == "vespo":
                k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
                phi = torch.exp(lam + k * log_w_seq - lam * torch.exp(log_w_seq))
                tok_loss = -phi * a * lp[b][t]
            else:
                if delta is not None:
                    w = torch.clamp(w, max=delta)
                tok_loss = -torch.minimum(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
            tok_loss = tok_loss * isw[b, t]
            d = ref[b, t] - lp[b][t]
            kl = torch.exp(d) - d - 1
            tok_loss = tok_loss + beta * (kl * raw_w if bias_kl else kl)
            terms[b][t] = tok_loss * mask[b, t]
    total = sum(sum(row) for row in terms)
    bonus = entropy_coef * sum(ent[b][t] * mask[b, t] for b in range(B) for t in range(T)) / max(float(mask.sum()), 1.0)
    if loss_type in ("grpo", "sapo"):
        return sum(sum(terms[b]) / max(float(mask[b].sum()), 1.0) for b in range(B)) / B - bonus
    if loss_type == "bnpo":
        return total / max(float(mask.sum()), 1.0) - bonus
    if loss_type == "dr_grpo":
        return total / (B * max_len) - bonus
    if loss_type == "luspo":
        return total / B - bonus
    return total / max(float(mask.sum()), 1.0) - bonus


def make_case(seed=0, B=3, T=4, V=11, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 2:] = 0
    mask[2] = 0  # a sequence with no completion tokens
    lp = torch.log_softmax(logits / 0.7, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    ref = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    isw = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    return logits, target, adv, mask, old, ref, isw


CASES = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], [0.0, 0.04], [0.2, 0.28], [None, 1.5], ["token", "sequence"]))
# TRL's other loss types, the bias-corrected KL and the entropy bonus (fewer combinations: the
# clip options above do not act on cispo's, sapo's or vespo's token loss)
NEW_CASES = [(lt, beta, eps_high, None, level, bias_kl, coef)
             for lt in ("cispo", "sapo", "vespo", "luspo") for beta in (0.0, 0.04) for eps_high in (0.28, 5.0)
             for level in ("token", "sequence") for bias_kl, coef in ((False, 0.0), (True, 0.3))]


@pytest.mark.parametrize("loss_type, beta, eps_high, delta, level, bias_kl, entropy_coef", NEW_CASES + [
    ("dapo", 0.04, 0.28, 1.5, "token", True, 0.3), ("grpo", 0.04, 0.2, None, "sequence", True, -0.1)])
def test_trl_loss_types_match_independent_float64(loss_type, beta, eps_high, delta, level, bias_kl, entropy_coef):
    options = LossOptions(beta=beta, epsilon_low=0.2, epsilon_high=eps_high, delta=delta, temperature=0.7,
                          loss_type=loss_type, importance_sampling_level=level, use_bias_correction_kl=bias_kl,
                          entropy_coef=entropy_coef)
    _check_spec_against_independent(options, seed=len(loss_type) + int(beta * 100) + int(eps_high) + 7 * (level == "sequence"))


def _check_spec_against_independent(options, seed, token_adv=False):
    """grpo_loss_reference (options) against independent_loss on make_case(seed): loss and logit gradients."""
    logits, target, adv, mask, old, ref, isw = make_case(seed=seed, token_adv=token_adv)
    logits.requires_grad_(True)
    eps_low, eps_high = options.clip_range
    expected = independent_loss(
        logits, target, adv, mask, old, ref, isw, beta=options.beta, eps_low=eps_low, eps_high=eps_high,
        delta=options.delta, temperature=options.temperature, loss_type=options.loss_type,
        level=options.importance_sampling_level, max_len=options.max_completion_length,
        bias_kl=options.use_bias_correction_kl, entropy_coef=options.entropy_coef)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    logits64 = logits.detach().clone().requires_grad_(True)
    loss, metrics = grpo_loss_reference(logits64, target, adv, mask, options, old_logp=old, ref_logp=ref, is_weights=isw)
    (grad,) = torch.autograd.grad(loss, logits64)
    # objective computes log-probs in float32 (as every backend does): the tolerance is fp32's
    assert_close(loss, expected, atol=scaled(1e-5, expected), rtol=1e-5, name="loss")
    assert_close(grad, grad_expected, atol=scaled(1e-5, grad_expected), rtol=1e-4, name="grad logits")
    assert grad.abs().sum() > 0, "the case must exercise a non-zero gradient"
    assert_close(grad[2], torch.zeros_like(grad[2]), atol=0, name="grad of the fully masked sequence")
    assert set(metrics) == set(objective.metric_names(options))


def test_cispo_and_vespo_metrics_match_independent_counts():
    logits, target, adv, mask, old, ref, isw = make_case(seed=5)
    lp = torch.log_softmax(logits / 0.7, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    w = torch.exp(lp - old)
    _, m = grpo_loss_reference(logits, target, adv, mask, LossOptions(loss_type="cispo", epsilon_high=1.0,
                                                                      temperature=0.7), old_logp=old)
    clipped = ((w > 1.0) & (adv[:, None] > 0)).double()
    assert_close(m["cispo_clip_ratio"], ((clipped * mask).sum() / mask.sum()).float(), atol=1e-7, name="cispo clip")
    assert 0 < float(m["cispo_clip_ratio"]) < 1, "the case must clip some tokens and not others"
    _, m = grpo_loss_reference(logits, target, adv, mask, LossOptions(loss_type="vespo", temperature=0.7), old_logp=old)
    log_w = ((lp - old) * mask).sum(-1)
    k = torch.where(adv >= 0, 2.0, 3.0)
    lam = torch.where(adv >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    expected = (phi[:, None] * mask).sum() / mask.sum()
    assert_close(m["vespo/phi_seq_mean"], expected.float(), atol=scaled(1e-6, expected), name="vespo phi")


def test_vespo_folds_the_is_ratio_into_its_weight():
    """vespo multiplies its sequence ratio by the vLLM IS ratios (a product over the sequence),
    instead of multiplying the token losses by them."""
    logits, target, adv, mask, old, _, isw = make_case(seed=4)
    options = LossOptions(loss_type="vespo", temperature=0.7)
    shifted_old = old - torch.log(isw)  # log(w * is) = lp - old + log is
    folded, _ = grpo_loss_reference(logits, target, adv, mask, options, old_logp=old, is_ratio=isw)
    by_old, _ = grpo_loss_reference(logits, target, adv, mask, options, old_logp=shifted_old)
    assert_close(folded, by_old, atol=scaled(1e-6, by_old), name="vespo loss with is_ratio")
    multiplied, _ = grpo_loss_reference(logits, target, adv, mask, options, old_logp=old, is_weights=isw)
    assert abs(float(multiplied - folded)) > 1e-3 * abs(float(folded)), "folding must differ from multiplying"
    with pytest.raises(ValueError, match="is_ratio is vespo's"):
        grpo_loss_reference(logits, target, adv, mask, LossOptions(), old_logp=old, is_ratio=isw)


def test_adaptive_entropy_controller_follows_trl():
    from grpo_fast.objective import adaptive_entropy_coef, applied_entropy_coef

    assert applied_entropy_coef(0.1, math.inf, adaptive=True, target=0.2) == 0.0  # the first step applies none
    assert applied_entropy_coef(0.1, 0.15, adaptive=True, target=0.2) == 0.1
    assert applied_entropy_coef(0.1, 0.25, adaptive=True, target=0.2) == 0.0
    assert applied_entropy_coef(0.1, 9.0, adaptive=False, target=0.2) == 0.1
    kw = dict(target=0.2, delta=0.005, coef_min=0.0, coef_max=0.012)
    assert adaptive_entropy_coef(0.01, 0.2, **kw) == 0.012  # up, capped
    assert adaptive_entropy_coef(0.003, 0.21, **kw) == 0.0  # down, floored
    assert adaptive_entropy_coef(0.008, 0.1, **dict(kw, coef_max=1.0)) == pytest.approx(0.013)


@pytest.mark.parametrize("loss_type, beta, eps_high, delta, level", CASES)
def test_loss_and_gradients_match_independent_float64(loss_type, beta, eps_high, delta, level):
    options = LossOptions(beta=beta, epsilon_low=0.2, epsilon_high=eps_high, delta=delta, temperature=0.7,
                          loss_type=loss_type, importance_sampling_level=level, max_completion_length=6)
    _check_spec_against_independent(options, seed=len(loss_type) + int(beta * 100), token_adv=delta is None)


def test_metrics_match_independent_counts():
    logits, target, adv, mask, old, ref, _ = make_case(seed=3, B=4, T=5, V=7)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 5)
    mask[0, 3:] = 0
    _, metrics = grpo_loss_reference(logits, target, adv, mask, LossOptions(epsilon_high=0.28), old_logp=old, ref_logp=ref)
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    w = torch.exp(lp - old)
    m = mask.bool()
    low = ((w < 0.8) & (adv[:, None] < 0))[m].double().mean()
    high = ((w > 1.28) & (adv[:, None] > 0))[m].double().mean()
    assert low > 0 and high > 0, "the case must clip on both sides"
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum(-1)[m].mean()
    d = (ref - lp)[m]
    assert_close(metrics["clip_ratio/low_mean"], low, atol=1e-6, name="clip low")
    assert_close(metrics["clip_ratio/high_mean"], high, atol=1e-6, name="clip high")
    assert_close(metrics["clip_ratio/region_mean"], low + high, atol=1e-6, name="clip region")
    assert_close(metrics["entropy"], entropy, atol=scaled(1e-5, entropy), name="entropy")
    kl = (d.exp() - d - 1).mean()
    assert_close(metrics["kl"], kl, atol=scaled(1e-5, kl), name="kl")


def test_dapo_uses_num_items_in_batch():
    logits, target, adv, mask, *_ = make_case(seed=5)
    local, _ = grpo_loss_reference(logits, target, adv, mask)
    global_, _ = grpo_loss_reference(logits, target, adv, mask, num_items_in_batch=4 * mask.sum())
    assert_close(global_, local / 4, atol=scaled(1e-7, local / 4), name="dapo loss")


def test_without_old_logp_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    logits, target, adv, mask, *_ = make_case(seed=7)
    logits.requires_grad_(True)
    loss, metrics = grpo_loss_reference(logits, target, adv, mask, LossOptions(loss_type="bnpo"))
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    pg = -(lp * adv[:, None] * mask).sum() / mask.sum()
    expected = torch.autograd.grad(pg, logits)[0]
    assert_close(torch.autograd.grad(loss, logits)[0], expected, atol=scaled(1e-6, expected), name="grad")
    assert metrics["clip_ratio/region_mean"] == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level"),
        (dict(beta=0.1), "ref_logp"),
        (dict(mask=torch.ones(3, 5)), r"mask must have shape \[3, 4\].*got \[3, 5\]"),
        (dict(advantages=torch.ones(4)), r"advantages must have shape \[3\] or \[3, 4\]"),
        (dict(old_logp=torch.zeros(3)), r"old_logp must have shape \[3, 4\]"),
        (dict(temperature=0.0), "temperature"),
        (dict(delta=0.5), "delta"),
    ],
)
def test_loss_errors_before_any_work(change, match):
    logits, target, adv, mask, *_ = make_case()
    tensors = dict(advantages=adv, mask=mask)
    tensors.update({k: v for k, v in change.items() if isinstance(v, torch.Tensor)})
    with pytest.raises(ValueError, match=match):  # options check themselves when built
        options = LossOptions(**{k: v for k, v in change.items() if not isinstance(v, torch.Tensor)})
        grpo_loss_reference(logits, target, options=options, **tensors)


def test_loss_is_finite_for_extreme_but_valid_inputs():
    logits = torch.tensor([[[80.0, -80.0, 0.0]]])
    loss, _ = grpo_loss_reference(logits, torch.tensor([[1]]), torch.tensor([1.0]), torch.ones(1, 1))
    assert math.isfinite(loss.item())


# ---------------------------------------------------------------------------------------------
# Loss options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("loss_type", "ppo", r"loss_type='ppo' is not supported; expected one of \['grpo', 'bnpo', 'dr_grpo', 'dapo', "
                             r"'cispo', 'sapo', 'vespo', 'luspo'\]"),
        ("sapo_temperature_pos", 0.0, r"sapo_temperature_pos must be a positive finite number, got 0.0"),
        ("vespo_lambda_neg", -1.0, r"vespo_lambda_neg must be a finite number >= 0, got -1.0"),
        ("use_bias_correction_kl", "yes", r"use_bias_correction_kl must be True or False, got 'yes'"),
        ("entropy_coef", float("inf"), r"entropy_coef must be a finite number, got inf"),
        ("beta", -0.1, r"beta must be a finite number >= 0, got -0.1"),
        ("epsilon_low", "0.2", r"epsilon_low must be a finite number >= 0, got '0.2'"),
        ("epsilon_high", float("nan"), r"epsilon_high must be a finite number >= 0 or None, got nan"),
        ("delta", 1.0, r"delta must be > 1 \(it caps the ratio from above\) or None, got 1.0"),
        ("temperature", 0, r"temperature must be a positive finite number, got 0"),
        ("importance_sampling_level", "batch", r"importance_sampling_level='batch' is not supported; expected one of \['token', 'sequence'\]"),
        ("max_completion_length", 0, r"max_completion_length must be an integer >= 1 or None, got 0"),
        ("mask_truncated_completions", 1, r"mask_truncated_completions must be True or False, got 1"),
        ("backend", "cuda", r"backend='cuda' is unknown; expected one of \['auto', 'triton', 'cpu', 'torch'\]"),
    ],
)
def test_loss_options_check_themselves_when_built(field, value, message):
    with pytest.raises(ValueError, match=message):
        LossOptions(**{field: value})


def test_loss_options_from_grpo_config():
    from grpo_fast.config import GRPOConfig

    config = GRPOConfig(loss_type="grpo", beta=0.04, epsilon=0.1, epsilon_high=0.3, delta=1.5, temperature=0.9,
                        importance_sampling_level="sequence", max_completion_length=32, mask_truncated_completions=True,
                        loss_backend="torch", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, vespo_k_pos=1.0,
                        vespo_lambda_pos=2.0, vespo_k_neg=4.0, vespo_lambda_neg=1.0, entropy_coef=0.01)
    assert LossOptions.from_config(config) == LossOptions(
        loss_type="grpo", beta=0.04, epsilon_low=0.1, epsilon_high=0.3, delta=1.5, temperature=0.9,
        importance_sampling_level="sequence", max_completion_length=32, mask_truncated_completions=True,
        backend="torch", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, vespo_k_pos=1.0, vespo_lambda_pos=2.0,
        vespo_k_neg=4.0, vespo_lambda_neg=1.0, use_bias_correction_kl=True, entropy_coef=0.01,
    )
    assert LossOptions(epsilon_low=0.1).clip_range == (0.1, 0.1) and LossOptions(epsilon_high=0.3).clip_range == (0.2, 0.3)


# ---------------------------------------------------------------------------------------------
# Kept sets (truncated sampling): the log-softmax over each position's set
# ---------------------------------------------------------------------------------------------


def test_kept_logprobs_are_the_renormalised_kept_distribution():
    """Independently: per position, the log-softmax of the set's logits alone (float64), its entropy, the
    gradient zero outside the set; an empty set is the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 11, generator=g) * 3).double().requires_grad_(True)
    target = torch.tensor([[4, 0, 10], [7, 7, 2]])
    sets = [[4, 1, 9], [], [10], [3, 7, 5, 0], [7, 8], list(range(11))]
    kept = objective.KeptSets.from_lists(sets)
    lp, entropy = objective.token_logprobs(logits, target, 0.7, logit_scale=1.5, logit_softcap=4.0, kept=kept)
    (lp.sum() + entropy.sum()).backward()
    z = objective.LogitMap(0.7, 1.5, 4.0)(logits.detach().double()).view(6, 11)
    for n, ids in enumerate(sets):
        ids = ids or list(range(11))
        q = torch.log_softmax(z[n, ids], -1)
        assert_close(lp.view(-1)[n], q[ids.index(int(target.view(-1)[n]))], atol=1e-6, name=f"logp {n}")
        assert_close(entropy.view(-1)[n], -(q.exp() * q).sum(), atol=1e-6, name=f"entropy {n}")
        outside = [i for i in range(11) if i not in ids]
        assert torch.isfinite(logits.grad).all() and not logits.grad.view(6, 11)[n, outside].any()
    full_lp, full_entropy = objective.token_logprobs(logits.detach(), target, 0.7, logit_scale=1.5, logit_softcap=4.0)
    assert torch.equal(lp.detach().view(-1)[1], full_lp.view(-1)[1])  # the empty set: the whole vocabulary
    assert_close(lp.detach().view(-1)[5], full_lp.view(-1)[5], atol=1e-6, name="a set of every id")
    none_lp, none_entropy = objective.token_logprobs(logits.detach(), target, 0.7, logit_scale=1.5, logit_softcap=4.0,
                                                     kept=None)
    assert torch.equal(none_lp, full_lp) and torch.equal(none_entropy, full_entropy)


@pytest.mark.parametrize("sets,offsets,pattern", [
    ([[1, 2], [3]], None, r"kept.offsets must have N \+ 1 = 4 entries"),
    ([[1, 2], [3], [11]], None, r"kept.ids must lie in \[0, 11\).*found 11"),
    ([[1, 2], [3, 3], [4]], None, r"position 1 keeps id 3 twice"),
    ([[1, 2], [5], [4]], None, r"the target id 3 at position 1 is not in its kept set \(1 ids\)"),
    (None, [0, 2, 1, 3], r"kept.offsets must be non-decreasing, got 2 then 1 at position 1"),
    (None, [1, 2, 3, 3], r"kept.offsets must run from 0 to len\(ids\) = 3"),
])
def test_kept_sets_are_checked(sets, offsets, pattern):
    kept = objective.KeptSets.from_lists(sets) if sets is not None else objective.KeptSets(
        torch.tensor([1, 3, 4]), torch.tensor(offsets))
    with pytest.raises(ValueError, match=pattern):
        objective.token_logprobs(torch.randn(3, 11), torch.tensor([1, 3, 4]), kept=kept)


def test_kept_sets_type_and_selection():
    with pytest.raises(ValueError, match="KeptSets.ids must be a 1-D int64 tensor"):
        objective.KeptSets(torch.tensor([1.0]), torch.tensor([0, 1]))
    kept = objective.KeptSets.from_lists([[1, 2], [], [5, 6, 7]])
    assert kept.lengths.tolist() == [2, 0, 3] and kept.truncates and not objective.KeptSets.none(3).truncates
    picked = kept.select(torch.tensor([2, 0]))
    assert picked.ids.tolist() == [5, 6, 7, 1, 2] and picked.offsets.tolist() == [0, 3, 5]

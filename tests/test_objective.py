"""The reference objective against the worked examples and an independent float64 computation."""

import itertools
import math
import warnings

import pytest
import torch

from grpo_fast import group_advantages, grpo_loss_reference
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
                     loss_type, level, max_len):
    """Plain loops in float64, written from docs/design.md without looking at objective.py."""
    B, T, V = logits.shape
    lp = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            z = logits[b, t] / temperature
            lp[b][t] = z[target[b, t]] - torch.logsumexp(z, 0)
    terms = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = sum(float(mask[b, t]) for t in range(T))
        seq = sum((lp[b][t] - old[b, t]) * mask[b, t] for t in range(T)) / max(n, 1.0)
        for t in range(T):
            a = adv[b, t] if adv.dim() == 2 else adv[b]
            w = torch.exp(seq if level == "sequence" else lp[b][t] - old[b, t])
            if delta is not None:
                w = torch.clamp(w, max=delta)
            tok_loss = -torch.minimum(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
            tok_loss = tok_loss * isw[b, t]
            d = ref[b, t] - lp[b][t]
            tok_loss = tok_loss + beta * (torch.exp(d) - d - 1)
            terms[b][t] = tok_loss * mask[b, t]
    total = sum(sum(row) for row in terms)
    if loss_type == "grpo":
        return sum(sum(terms[b]) / max(float(mask[b].sum()), 1.0) for b in range(B)) / B
    if loss_type == "bnpo":
        return total / max(float(mask.sum()), 1.0)
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / max(float(mask.sum()), 1.0)


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


@pytest.mark.parametrize("loss_type, beta, eps_high, delta, level", CASES)
def test_loss_and_gradients_match_independent_float64(loss_type, beta, eps_high, delta, level):
    logits, target, adv, mask, old, ref, isw = make_case(seed=len(loss_type) + int(beta * 100), token_adv=delta is None)
    logits.requires_grad_(True)
    kw = dict(beta=beta, eps_low=0.2, eps_high=eps_high, delta=delta, temperature=0.7, loss_type=loss_type, level=level, max_len=6)
    expected = independent_loss(logits, target, adv, mask, old, ref, isw, **kw)
    (grad_expected,) = torch.autograd.grad(expected, logits)

    logits64 = logits.detach().clone().requires_grad_(True)
    options = LossOptions(beta=beta, epsilon_low=0.2, epsilon_high=eps_high, delta=delta, temperature=0.7,
                          loss_type=loss_type, importance_sampling_level=level, max_completion_length=6)
    loss, metrics = grpo_loss_reference(logits64, target, adv, mask, options, old_logp=old, ref_logp=ref, is_weights=isw)
    (grad,) = torch.autograd.grad(loss, logits64)
    # objective computes log-probs in float32 (as every backend does): the tolerance is fp32's
    assert_close(loss, expected, atol=scaled(1e-5, expected), rtol=1e-5, name="loss")
    assert_close(grad, grad_expected, atol=scaled(1e-5, grad_expected), rtol=1e-4, name="grad logits")
    assert grad.abs().sum() > 0, "the case must exercise a non-zero gradient"
    assert_close(grad[2], torch.zeros_like(grad[2]), atol=0, name="grad of the fully masked sequence")


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
        ("loss_type", "ppo", r"loss_type='ppo' is not supported; expected one of \['grpo', 'bnpo', 'dr_grpo', 'dapo'\]"),
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
                        loss_backend="torch")
    assert LossOptions.from_config(config) == LossOptions(
        loss_type="grpo", beta=0.04, epsilon_low=0.1, epsilon_high=0.3, delta=1.5, temperature=0.9,
        importance_sampling_level="sequence", max_completion_length=32, mask_truncated_completions=True,
        backend="torch",
    )
    assert LossOptions(epsilon_low=0.1).clip_range == (0.1, 0.1) and LossOptions(epsilon_high=0.3).clip_range == (0.2, 0.3)

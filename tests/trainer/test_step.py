"""One optimizer step over packed token-budget micro-batches gives the gradient of the loss over the
whole step computed the plain way (padded batch, materialised logits, grpo_fast.objective)."""

import dataclasses
import functools

import pytest
import torch

from grpo_fast import objective
from grpo_fast.generation.batch import Rollouts
from grpo_fast.objective import grpo_loss_reference
from grpo_fast.train.forward import Packer, attention_mode, completion_logprobs
from grpo_fast.train.logprobs import importance_weights
from grpo_fast.train.step import LossOptions, train_step
from tests.helpers import assert_close, scaled


class CaptureGrads:
    """An optimizer stand-in that records the gradients train_step hands it."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    completions[2] = []  # an empty completion: no tokens, still one of the step's sequences
    batch = Rollouts(prompts, completions, [torch.zeros(len(c)) for c in completions], ["stop", "length"] * (n // 2),
                     [""] * n, [{}] * n)
    batch.advantages = torch.randn(n, generator=g)
    batch.old_logp = [-torch.rand(len(c), generator=g) * 6 for c in completions]
    batch.ref_logp = [-torch.rand(len(c), generator=g) * 6 for c in completions]
    batch.is_weights = [torch.rand(len(c), generator=g) + 0.5 for c in completions]
    return batch


def _reference_grads(model, batch, options, num_items_in_batch=None, masks=None):
    """Padded right-aligned batch, logits materialised, loss from the objective, autograd.
    masks: (top_entropy_quantile, off_policy_mask_threshold) as train_step takes them (one micro-batch)."""
    rows = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    width, tc = max(map(len, rows)), max(max(len(c) for c in batch.completion_ids), 1)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
    logits = model(input_ids=ids, attention_mask=attn).logits
    pick = torch.zeros(len(rows), tc, dtype=torch.long)
    target, mask = torch.zeros_like(pick), torch.zeros(len(rows), tc)
    pad = lambda xs: None if xs is None else torch.stack([torch.cat([x, torch.zeros(tc - len(x))]) for x in xs])
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        keep = c and not (options.mask_truncated_completions and batch.finish_reason[i] == "length")
        pick[i, : len(c)] = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        target[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = float(bool(keep))
        if batch.loss_mask is not None:  # a rollout mode's masked tokens (injected text, a continued thought)
            mask[i, : len(c)] *= batch.loss_mask[i].float()
    chosen = logits[torch.arange(len(rows))[:, None], pick]  # (B, Tc, V)
    is_weights, is_ratio = pad(batch.is_weights), None
    if options.loss_type == "vespo":
        is_weights, is_ratio = None, is_weights
    entropy_weights = None
    if masks is not None:
        quantile, threshold = masks
        lp, entropy = objective.token_logprobs(chosen.detach(), target, options.temperature)
        entropy_mask = objective.high_entropy_mask(entropy, mask, 1 - quantile)
        opsm = objective.off_policy_mask(batch.advantages, lp, pad(batch.sampling_logp), mask, threshold)
        is_weights = is_weights * entropy_mask * opsm
        entropy_weights = objective.entropy_bonus_weights(mask, entropy_mask)
    loss, _ = grpo_loss_reference(
        chosen, target, batch.advantages, mask, options, old_logp=pad(batch.old_logp), ref_logp=pad(batch.ref_logp),
        is_weights=is_weights, is_ratio=is_ratio, entropy_weights=entropy_weights, num_items_in_batch=num_items_in_batch,
    )
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type, level, mask_truncated", [
    ("dapo", "token", False), ("grpo", "token", True), ("dr_grpo", "token", False), ("dapo", "sequence", False),
])
def test_micro_batched_step_matches_whole_batch_reference(tiny, loss_type, level, mask_truncated):
    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=loss_type, beta=0.05, epsilon_low=0.2, epsilon_high=0.28, delta=None,
                          temperature=0.8, importance_sampling_level=level, max_completion_length=12,
                          mask_truncated_completions=mask_truncated, backend="cpu")
    batch = _batch()
    expected = _reference_grads(model, batch, options)
    optimizer = CaptureGrads(model)
    packer = Packer(model, max_tokens=24)  # several micro-batches
    metrics = train_step(model, optimizer, packer, batch, options, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] >= 2 and metrics["skipped"] == 0
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"{loss_type}/{level} grad {name}")


# Every row of the loss-type table, over several micro-batches (each aggregation's accumulation rule), but
# bnpo: it normalises each micro-batch by that micro-batch's own tokens (TRL's rule), so no whole-batch
# reference exists for it; dr_grpo needs its constant L (else each micro-batch's own T).
LEVEL_AND_OPTIONS = {"cispo": ("token", dict(epsilon_high=1.2)), "sapo": ("token", dict(use_bias_correction_kl=True)),
                     "luspo": ("sequence", dict(use_bias_correction_kl=True)),
                     "dr_grpo": ("token", dict(max_completion_length=12))}


@pytest.mark.parametrize("loss_type, level, extra", [(lt, *LEVEL_AND_OPTIONS.get(lt, ("token", {})))
                                                     for lt in objective.LOSS_TYPES if lt != "bnpo"])
def test_trl_loss_types_micro_batched_match_whole_batch_reference(tiny, loss_type, level, extra):
    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=loss_type, beta=0.05, temperature=0.8, importance_sampling_level=level,
                          backend="cpu", **extra)
    batch = _batch(seed=2)
    expected = _reference_grads(model, batch, options)
    optimizer = CaptureGrads(model)
    metrics = train_step(model, optimizer, Packer(model, max_tokens=24), batch, options, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] >= 2 and metrics["skipped"] == 0
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"{loss_type} grad {name}")


# The entropy bonus is each micro-batch's masked mean / the number of micro-batches (TRL's rule), so the
# whole-batch reference holds with one micro-batch; TRL's token masks come from the same pass.
@pytest.mark.parametrize("loss_type, masks", [("dapo", None), ("grpo", None), ("cispo", (0.5, 0.05)),
                                              ("bnpo", (0.6, 0.0))])
def test_entropy_bonus_and_token_masks_step_match_reference(tiny, loss_type, masks):
    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=loss_type, beta=0.05, temperature=0.8, entropy_coef=0.2, backend="cpu",
                          epsilon_high=1.2 if loss_type == "cispo" else None)
    batch = _batch(seed=3)
    g = torch.Generator().manual_seed(4)
    batch.sampling_logp = [o + 0.5 * torch.randn(len(o), generator=g) for o in batch.old_logp]
    expected = _reference_grads(model, batch, options, masks=masks)
    optimizer = CaptureGrads(model)
    kw = {} if masks is None else dict(top_entropy_quantile=masks[0], off_policy_mask_threshold=masks[1])
    metrics = train_step(model, optimizer, Packer(model, max_tokens=4096), batch, options, max_grad_norm=0.0, **kw)
    assert metrics["num_micro_batches"] == 1
    without = _reference_grads(model, batch, dataclasses.replace(options, entropy_coef=0.0), masks=masks)
    assert max((expected[n] - without[n]).abs().max().item() for n in expected) > 1e-4, "the bonus must move the gradient"
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"{loss_type} grad {name}")


# The rollout modes of the GRPO variants train sequences whose injected text (early_exit) or
# continued thought (multi_answer) is masked: per token, the sequence's advantage or nothing.
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "token"), ("dapo", "sequence"), ("dr_grpo", "token")])
def test_loss_masked_tokens_step_matches_reference(tiny, loss_type, level):
    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=loss_type, beta=0.05, temperature=0.8, importance_sampling_level=level,
                          max_completion_length=12, backend="cpu")
    batch = _batch(seed=5)
    batch.loss_mask = [torch.ones(len(c), dtype=torch.bool) for c in batch.completion_ids]
    batch.loss_mask[0][1:-1] = False  # a cut: prefix, injected text, answer
    batch.loss_mask[1][:] = False  # nothing of it trained: left out of the step
    batch.loss_mask[3][: len(batch.loss_mask[3]) // 2] = False  # an answer after its thought
    expected = _reference_grads(model, batch, options)
    unmasked = _reference_grads(model, dataclasses.replace(batch, loss_mask=None), options)
    assert max((expected[n] - unmasked[n]).abs().max().item() for n in expected) > 1e-4, "the mask must matter"
    optimizer = CaptureGrads(model)
    metrics = train_step(model, optimizer, Packer(model, max_tokens=24), batch, options, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] >= 2 and metrics["skipped"] == 0
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"{loss_type} grad {name}")


def test_dapo_normaliser_from_the_generation_batch(tiny):
    """The trainer passes the generation batch's token count / steps_per_generation (TRL's normaliser)."""
    model, _ = tiny
    options = LossOptions(loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, temperature=1.0,
                          importance_sampling_level="token", max_completion_length=12, mask_truncated_completions=False,
                          backend="torch")
    batch = _batch(seed=1)
    expected = _reference_grads(model, batch, options, num_items_in_batch=37.5)
    optimizer = CaptureGrads(model)
    train_step(model, optimizer, Packer(model, max_tokens=24), batch, options, max_grad_norm=0.0, num_items_in_batch=37.5)
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"grad {name}")


def test_gradient_checkpointing_step_matches_whole_batch_reference(tiny):
    """Checkpointing recomputes each layer during backward, after the packed-attention switch is
    undone: such a model packs with the dense mask instead, and its gradients stay right."""
    model, _ = tiny
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert attention_mode(model) == "mask"
    options = LossOptions(loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=0.28, delta=None,
                          temperature=0.8, importance_sampling_level="token", max_completion_length=12,
                          mask_truncated_completions=False, backend="cpu")
    batch = _batch()
    expected = _reference_grads(model, batch, options)
    optimizer = CaptureGrads(model)
    metrics = train_step(model, optimizer, Packer(model, max_tokens=24), batch, options, max_grad_norm=0.0)
    assert metrics["num_micro_batches"] >= 2
    for name, grad in expected.items():
        assert_close(optimizer.grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"checkpointed grad {name}")


# One update per generation batch: the IS weights come from the step's own forward (no old-policy
# pass), and must equal those of the separate pass the trainer runs otherwise.
@pytest.mark.parametrize("loss_type, mode", [("dapo", "sequence_mask"), ("grpo", "token_truncate"),
                                             ("vespo", "token_mask")])
def test_in_step_importance_weights_match_a_separate_old_policy_pass(tiny, loss_type, mode):
    model, _ = tiny
    model.train()
    options = LossOptions(loss_type=loss_type, temperature=0.8, backend="cpu")
    batch = _batch(seed=6)
    batch.old_logp = None  # on-policy: the loss takes old = its own log-probs, detached
    packer = Packer(model, max_tokens=24)  # several micro-batches
    trainer = completion_logprobs(model, packer, batch.prompt_ids, batch.completion_ids, temperature=0.8, backend="cpu")
    g = torch.Generator().manual_seed(7)
    batch.sampling_logp = [t + 0.3 * torch.randn(len(t), generator=g) for t in trainer]  # an engine in bf16, say
    weigh = functools.partial(importance_weights, mode=mode, cap=1.2, clip_min=0.3)
    batch.is_weights = [weigh(t, s) for t, s in zip(trainer, batch.sampling_logp, strict=True)]
    flat = torch.cat(batch.is_weights)
    bound = (flat == 0) | (flat == 0.3) | (flat == 1.2)
    assert 0 < bound.sum() < len(flat), "the bounds must bind on some tokens, not all"
    separate = CaptureGrads(model)
    expected = train_step(model, separate, packer, batch, options, max_grad_norm=0.0)
    in_step = CaptureGrads(model)
    got = train_step(model, in_step, packer, dataclasses.replace(batch, is_weights=None), options, max_grad_norm=0.0,
                     importance_weights=weigh)
    assert got["num_micro_batches"] >= 2
    for name, grad in separate.grads.items():
        assert_close(in_step.grads[name], grad, atol=scaled(1e-5, grad), rtol=1e-4, name=f"{loss_type}/{mode} grad {name}")
    assert_close(torch.tensor(got["loss"]), torch.tensor(expected["loss"]), atol=scaled(1e-5, expected["loss"]), name="loss")
    gaps = torch.cat([(t - s).abs() for t, s in zip(trainer, batch.sampling_logp, strict=True)
                      if len(t) and s is not None])
    kept = torch.cat([w for w, c in zip(batch.is_weights, batch.completion_ids, strict=True) if c])
    for name, value in (("sampling/logp_diff_mean", gaps.mean()), ("sampling/logp_diff_max", gaps.max()),
                        ("sampling/importance_sampling_ratio/min", kept.min()),
                        ("sampling/importance_sampling_ratio/mean", kept.mean()),
                        ("sampling/importance_sampling_ratio/max", kept.max())):
        assert_close(torch.tensor(got[name]), value, atol=scaled(1e-5, value), name=name)

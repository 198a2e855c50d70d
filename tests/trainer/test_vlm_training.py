"""A vision-language model through the training stages (issue 51): the optimizer step and the log-probs stage.

The tiny Qwen2-VL (M-RoPE) of tests/models/test_vision.py, its image encoder frozen (freeze_vision_tower's default).
- Two groups' image tokens in one packed row train as one group per row: the same loss and gradients.
- A step moves the language model and lm_head, never the frozen encoder.
- The log-probs stage's old-policy and reference passes see the images (a pass without them is refused:
  tests/models/test_vision.py): the reference, a frozen copy at step 0, gives the policy's log-probs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_fast.distributed import ONE_PROCESS, Parallel
from grpo_fast.models import vision
from grpo_fast.models.policy import Policy, Reference, frozen_copy
from grpo_fast.train.forward import Packer, completion_logprobs
from grpo_fast.train.logprobs import ISPolicy, side_inputs
from grpo_fast.train.step import train_step
from tests.helpers import assert_close, scaled
from tests.models.test_vision import OPTIONS, CaptureGrads, G, tiny_vlm, vlm_batch


@pytest.fixture(scope="module")
def qwen2_vl():
    model, processor = tiny_vlm("qwen2_vl")
    vision.freeze_encoder(model)
    return model, processor


def test_two_groups_in_one_packed_row_train_as_one_group_per_row(qwen2_vl):
    model, processor = qwen2_vl
    batch = vlm_batch("qwen2_vl", processor, n_images=(3, 1), seed=5)
    lengths = [len(p) + len(c) - 1 for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    runs = {}
    for budget in (sum(lengths), max(sum(lengths[:G]), sum(lengths[G:]))):  # both groups in one row; one per row
        trained = copy.deepcopy(model)
        packer = Packer(trained, max_tokens=budget)
        rows = [mb.rows for mb in packer.micro_batches(batch.prompt_ids, batch.completion_ids, images=batch.image_inputs)]
        optimizer = CaptureGrads(trained)
        runs[len(rows)] = (rows, train_step(trained, optimizer, packer, batch, OPTIONS, max_grad_norm=1.0), optimizer.grads)
    (one_row, packed, packed_grads), (per_group, apart, apart_grads) = runs[1], runs[2]
    assert one_row == [list(range(2 * G))] and sorted(per_group) == [list(range(G)), list(range(G, 2 * G))]
    for name in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean"):
        assert_close(packed[name], apart[name], atol=scaled(1e-5, apart[name]), name=name)
    assert packed_grads.keys() == apart_grads.keys()
    for name, grad in apart_grads.items():
        assert_close(packed_grads[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"grad {name}")


def test_a_step_moves_the_language_model_not_the_frozen_encoder(qwen2_vl):
    model = copy.deepcopy(qwen2_vl[0])
    batch = vlm_batch("qwen2_vl", qwen2_vl[1], n_images=(1,), seed=7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = train_step(model, optimizer, Packer(model, max_tokens=4096), batch, OPTIONS, max_grad_norm=1.0)
    assert metrics["skipped"] == 0
    encoder = tuple(vision.encoder_modules(model))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(n.startswith(encoder) for n in moved)
    assert any(".language_model." in n for n in moved) and "lm_head.weight" in moved


def test_log_probs_stage_runs_the_old_policy_and_the_reference_on_the_images(qwen2_vl):
    model, processor = qwen2_vl
    batch = vlm_batch("qwen2_vl", processor, n_images=(3, 1), seed=9)
    packer = Packer(model, max_tokens=4096)
    own = completion_logprobs(model, packer, batch.prompt_ids, batch.completion_ids, temperature=OPTIONS.temperature,
                              backend="cpu", images=batch.image_inputs)
    batch.sampling_logp = [lp + 0.01 for lp in own]
    policy = Policy(model, None, None, packer, Parallel(model, ONE_PROCESS),
                    Reference(frozen_copy(model), Parallel(model, ONE_PROCESS)))
    is_policy = ISPolicy(shares_weights=False, use_is=True, in_step=False, needs_old_logp=True, mode="token_truncate",
                         cap=3.0, clip_min=None)
    side = side_inputs(batch, policy, is_policy, temperature=OPTIONS.temperature, backend="cpu", check=False)
    for i, expected in enumerate(own):
        assert_close(side.old_logp[i], expected, atol=scaled(1e-6, expected), name=f"old log-probs {i}")
        assert_close(side.ref_logp[i], expected, atol=scaled(1e-6, expected), name=f"reference log-probs {i}")
        assert_close(side.is_weights[i], torch.full_like(expected, -0.01).exp(), atol=1e-5, name=f"IS weights {i}")
    assert side.metrics["sampling/logp_diff_max"] == pytest.approx(0.01, rel=1e-3)


def test_a_trained_image_encoder_is_refused_on_many_ranks_by_name():
    """DDP with the encoder frozen trains as one process (checked by hand: 2 gloo ranks, each one group, gradients
    within 7e-7 relative of one process's); a trained encoder runs outside DDP's forward and is refused there."""
    from grpo_fast import config_checks
    from grpo_fast.config import GRPOConfig

    with pytest.raises(ValueError, match=r"^GRPOConfig.freeze_vision_tower=False is not supported under torchrun "
                                         r"\(WORLD_SIZE=2\) yet: a VLM's image encoder trains in one process"):
        config_checks.check_ranks(GRPOConfig(freeze_vision_tower=False), 2)
    config_checks.check_ranks(GRPOConfig(), 2)


def test_grpo_trainer_trains_a_vlm_on_image_rows(tmp_path):
    """The native trainer end to end (tests/tiny_vlm.py's Qwen2-VL folder, its processor, TRL's `images` column, the HF
    engine, beta > 0): a step with a finite loss, the language model moved, the frozen encoder untouched, and the
    training step's encoder calls one per prompt."""
    from grpo_fast.train import step as step_stage
    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_vlm import image_rows, tiny_vlm_dir
    from tests.trainer.common import config, target_fraction

    c = config(tmp_path, model=tiny_vlm_dir("qwen2_vl"), per_device_train_batch_size=8, max_steps=1,
               max_prompt_length=None, max_completion_length=6, max_tokens_per_microbatch=512, beta=0.04,
               eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [target_fraction], image_rows(2, images_per_row=2))
    calls, in_step = [], []
    trainer.model.model.visual.register_forward_hook(lambda *_: calls.append(bool(in_step)))
    train_step = step_stage.train_step

    def counted(*args, **kwargs):
        in_step.append(1)
        try:
            return train_step(*args, **kwargs)
        finally:
            in_step.clear()

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    step_stage.train_step = counted
    try:
        metrics = trainer.train()
    finally:
        step_stage.train_step = train_step
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["kl"] >= 0
    assert sum(calls) == 2  # two prompts, G = 4 each, one micro-batch
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".visual." in n for n in moved)


def test_a_vlm_trains_under_truncated_sampling(tmp_path):
    """top_k with images: the old-policy pass over the kept sets (train/kept_sets.policy_pass) runs the image encoder
    too (it once packed the rows without their images and refused the placeholders)."""
    from grpo_fast.trainer import GRPOTrainer
    from tests.tiny_vlm import image_rows, tiny_vlm_dir
    from tests.trainer.common import config, target_fraction

    c = config(tmp_path, model=tiny_vlm_dir("qwen2_vl"), per_device_train_batch_size=8, max_steps=1,
               max_prompt_length=None, max_completion_length=6, max_tokens_per_microbatch=512, beta=0.04,
               top_k=5, num_iterations=2, sampling_check_steps=1, eval_before_train=False, save_final=False)
    metrics = GRPOTrainer(c, [target_fraction], image_rows(2, images_per_row=1)).train()
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert abs(metrics["sampling/engine_ratio_mean"] - 1.0) < 1e-3  # fp32, the HF engine's own sets: the same numbers

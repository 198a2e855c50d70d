"""Truncated sampling in training (train/kept_sets.py): the loss, the old-policy pass and the engine-vs-trainer
figures run over each token's kept set, so on the HF engine in float32 (it samples with the policy itself) the
trainer's log-probs are exactly the engine's; without the sets they are off by the mass the truncation cut."""

import dataclasses
import json
import os
from types import SimpleNamespace

import torch

from grpo_fast.generation.batch import from_engine
from grpo_fast.generation.engines.base import SamplingOptions
from grpo_fast.generation.engines.hf_engine import HFEngine
from grpo_fast.train import kept_sets
from grpo_fast.train.forward import Packer
from grpo_fast.train.logprobs import importance_weights
from grpo_fast.train.step import LossOptions, train_step
from grpo_fast.trainer import GRPOTrainer
from tests.helpers import assert_close, scaled
from tests.trainer.common import config, rows, target_fraction
from tests.trainer.test_step import CaptureGrads


def test_a_step_with_top_p_and_top_k_trains_over_the_engines_kept_sets(tmp_path, tiny):
    model, tokenizer = tiny
    c = config(tmp_path, max_steps=1, top_p=0.8, top_k=20, eval_before_train=False, save_final=False)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer)
    assert trainer.kept_source.source == "engine"
    assert trainer.precision_summary().endswith("truncated sampling (top_k=20, top_p=0.8): kept sets returned by the "
                                                "engine; every log-softmax runs over them")
    trainer.train()
    with open(os.path.join(c.output_dir, "metrics.jsonl")) as f:
        (line,) = [r for r in map(json.loads, f) if "reward" in r]
    # the step-0 sampling check: the policy's log-probs over the kept sets are the engine's (the same weights)
    assert abs(line["sampling/engine_ratio_mean"] - 1) < 1e-5 and line["sampling/engine_ratio_outside"] == 0.0, line
    assert line["sampling/logp_diff_max"] < 1e-4, line
    # over the whole vocabulary each token's ratio would be 1 - the mass its truncation cut: visibly not 1
    assert line["sampling/kept_mass_mean"] > 0.2, line
    assert "sampling/kept_set_misses" not in line  # (nothing rebuilt: the engine returned them)


def test_the_step_rebuilds_the_kept_sets_the_engine_returned(tiny):
    """One update per batch with the IS correction (vLLM's case): the step's own forward rebuilds the kept sets
    from the old policy's hidden states with vLLM's rule; they are the HF engine's (its warpers are that rule), so
    the update, the loss and the IS weights are those of the returned sets, and no sampled token is missed."""
    model, tokenizer = tiny
    model.train()
    sampling = SamplingOptions(temperature=0.8, top_p=0.8, top_k=20, min_p=0.01)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    batch = from_engine(HFEngine(model, tokenizer).generate(prompts, n=2, max_new_tokens=6, sampling=sampling, seed=[1, 2, 3]),
                        prompts, [{}] * 3)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    options = LossOptions(temperature=0.8, backend="cpu")
    weigh = lambda t, s: importance_weights(t, s, mode="token_truncate", cap=3.0, clip_min=None)  # noqa: E731
    returned, rebuilt = (kept_sets.KeptSource.resolve(sampling, SimpleNamespace(returns_kept_sets=r),
                                                      SimpleNamespace(carries_kept_sets=True)) for r in (True, False))
    assert (returned.source, rebuilt.source) == ("engine", "reconstructed")
    packer = Packer(model, max_tokens=16)  # several micro-batches
    grads = {}
    for name, source, kept in (("returned", returned, batch.kept), ("rebuilt", rebuilt, None)):
        grads[name] = CaptureGrads(model)
        metrics = train_step(model, grads[name], packer, dataclasses.replace(batch, kept=kept), options,
                             max_grad_norm=0.0, importance_weights=weigh, kept_source=source)
        assert metrics["num_micro_batches"] >= 2
        assert abs(metrics["sampling/engine_ratio_mean"] - 1) < 1e-5 and metrics["sampling/logp_diff_max"] < 1e-4
        assert metrics["sampling/kept_mass_mean"] > 0.2
        grads[name].metrics = metrics
    assert grads["rebuilt"].metrics["sampling/kept_set_misses"] == 0
    for key in ("loss", "entropy", "sampling/kept_mass_mean"):
        want = torch.tensor(grads["returned"].metrics[key])
        assert_close(torch.tensor(grads["rebuilt"].metrics[key]), want, atol=scaled(1e-6, want), name=key)
    for name, grad in grads["returned"].grads.items():
        assert_close(grads["rebuilt"].grads[name], grad, atol=scaled(1e-6, grad), rtol=1e-5, name=f"grad {name}")

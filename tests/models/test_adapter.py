"""The model adapter: the native trainer takes a model's own logit map (and refuses one the ops cannot take)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from grpo_fast import models
from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import build_tiny_model, load_tiny_model
from tests.trainer.common import config, rows, target_fraction


@pytest.fixture(scope="module")
def unscalable(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("unscalable"), logit_scale=-1.0)


def test_a_logit_map_the_ops_cannot_take_is_refused_before_the_weights_load(tmp_path, unscalable, monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    with pytest.raises(ValueError, match=r"config\.logit_scale=-1\.0 cannot scale the logits"):
        GRPOTrainer(config(tmp_path, model=unscalable, engine="vllm"), [target_fraction], rows())


def test_a_logit_map_of_a_model_passed_in_is_refused_before_the_engine(tmp_path, unscalable, monkeypatch):
    from grpo_fast.generation.engines import build

    monkeypatch.setattr(build, "build_engine", lambda *a, **k: pytest.fail("the engine started before the check"))
    model, tokenizer = load_tiny_model(unscalable)
    with pytest.raises(ValueError, match=r"model: config\.logit_scale=-1\.0"):
        GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=model, tokenizer=tokenizer)


def test_a_soft_capped_model_trains_on_the_samplers_log_probs(tmp_path):
    """Gemma 2 (tiny, random; soft-cap 2 so that it bends the logits): the HF engine samples from the model's own
    soft-capped logits, and the trainer's fused log-probs of those tokens are the same numbers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.tiny_model import build_tiny_tokenizer

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, final_logit_softcapping=2.0, attn_logit_softcapping=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: the cap at 2 bends them
    model.save_pretrained(tmp_path / "gemma2")
    build_tiny_tokenizer(320).save_pretrained(tmp_path / "gemma2")
    trainer = GRPOTrainer(config(tmp_path, model=str(tmp_path / "gemma2"), max_steps=1, sampling_check_steps=1,
                                 temperature=0.8), [target_fraction], rows())
    assert (trainer.options.loss.logit_scale, trainer.options.loss.logit_softcap) == (1.0, 2.0)
    trainer.train()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        step = [json.loads(line) for line in f if '"loss"' in line][0]
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
    # float32 on both sides: the same numbers up to the matmuls' order (without the cap: ~0.1 apart)
    assert step["sampling/logp_diff_max"] < 1e-4, step["sampling/logp_diff_max"]


def test_the_trainer_does_not_import_the_trl_integration():
    code = "import sys, grpo_fast.trainer; print(any(m.startswith('grpo_fast.integrations') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"

"""The model adapter: the native trainer refuses a model whose logits the fused path cannot reproduce."""

import subprocess
import sys

import pytest

from grpo_fast import models
from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import build_tiny_model, load_tiny_model
from tests.trainer.common import config, rows, target_fraction


@pytest.fixture(scope="module")
def softcapped(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("softcap"), final_logit_softcapping=30.0)


def test_logit_transform_is_refused_before_the_weights_load(tmp_path, softcapped, monkeypatch):
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    with pytest.raises(ValueError, match=r"config\.final_logit_softcapping=30\.0 transforms the logits"):
        GRPOTrainer(config(tmp_path, model=softcapped, engine="vllm"), [target_fraction], rows())


def test_logit_transform_of_a_model_passed_in_is_refused_before_the_engine(tmp_path, softcapped, monkeypatch):
    from grpo_fast.generation.engines import build

    monkeypatch.setattr(build, "build_engine", lambda *a, **k: pytest.fail("the engine started before the check"))
    model, tokenizer = load_tiny_model(softcapped)
    with pytest.raises(ValueError, match=r"model: config\.final_logit_softcapping=30\.0"):
        GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=model, tokenizer=tokenizer)


def test_the_trainer_does_not_import_the_trl_integration():
    code = "import sys, grpo_fast.trainer; print(any(m.startswith('grpo_fast.integrations') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"

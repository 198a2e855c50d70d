"""LoRA adapters in the native trainer (peft), on the tiny model and the HF engine: only the adapter trains,
its gradients are a plain LoRA forward's through the unfused loss, the reference is the base exactly (or the
adapter a run started from), checkpoints and final/ hold the adapter, bad input is refused before work.

Adapters start away from zero (`init_lora_weights=False`): a test that the adapter is used must be able to fail.
"""

import copy
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from grpo_fast.config import GRPOConfig
from grpo_fast.models import lora
from grpo_fast.train.forward import Packer, completion_logprobs
from grpo_fast.train.step import LossOptions, train_step
from grpo_fast.trainer import GRPOTrainer
from tests.helpers import assert_close, scaled
from tests.tiny_model import load_tiny_model
from tests.trainer.common import config, rows, target_fraction
from tests.trainer.test_step import CaptureGrads, _batch, _reference_grads

TOL = 1e-5  # float32 log-probs of the tiny model: the same computation differs by ~1e-6


def _peft_config(**extra):
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **extra)


def _logp(model, batch):
    return torch.cat(completion_logprobs(model, Packer(model, max_tokens=64), batch.prompt_ids, batch.completion_ids,
                                         temperature=1.0, backend="cpu"))


class PlainLoRA(torch.nn.Module):
    """y = x W^T + s (x A^T) B^T with its own A, B: LoRA written out, no peft."""

    def __init__(self, base: torch.nn.Linear, a, b, scaling: float):
        super().__init__()
        self.weight, self.scaling = base.weight, scaling
        self.lora_A, self.lora_B = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())

    def forward(self, x):
        return x @ self.weight.T + self.scaling * (x @ self.lora_A.T) @ self.lora_B.T


def test_adapter_gradients_equal_a_plain_lora_forward_through_the_unfused_loss(tiny_path):
    model, _ = load_tiny_model(tiny_path)
    plain = copy.deepcopy(model)
    peft_model = lora.apply_lora(model, config_for_peft(), peft_config=_peft_config())
    for name, layer in lora._lora_layers(peft_model.get_base_model()):  # the same adapter, written out
        parent, child = name.rsplit(".", 1)
        base = plain.get_submodule(name)
        setattr(plain.get_submodule(parent), child, PlainLoRA(base, layer.lora_A["default"].weight,
                                                              layer.lora_B["default"].weight, layer.scaling["default"]))
    options = LossOptions(loss_type="dapo", beta=0.05, temperature=0.8, backend="cpu")
    batch = _batch(seed=5)
    expected = {n: g for n, g in _reference_grads(plain, batch, options).items() if ".lora_" in n}
    optimizer = CaptureGrads(peft_model)
    train_step(peft_model, optimizer, Packer(peft_model, max_tokens=24), batch, options, max_grad_norm=0.0)
    got = {n.replace("base_model.model.", "").replace(".default.weight", ""): g for n, g in optimizer.grads.items()}
    assert set(got) == set(expected), "only the adapter's A and B get gradients"
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        assert_close(got[name], grad, atol=scaled(2e-5, grad), rtol=1e-3, name=f"lora grad {name}")


def config_for_peft(**overrides):
    return GRPOConfig(**{"use_peft": True, "lora_r": 4, "lora_alpha": 8, "engine": "hf", **overrides})


def test_only_the_adapter_trains_the_reference_is_the_base_and_final_holds_the_adapter(tmp_path, tiny_path):
    model, tokenizer = load_tiny_model(tiny_path)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    c = config(tmp_path, beta=0.04, save_steps=1, save_merged=True)
    trainer = GRPOTrainer(c, [target_fraction], rows(), model=model, tokenizer=tokenizer, peft_config=_peft_config())
    peft_model = trainer.model
    assert c.use_peft is False and trainer.config.use_peft and trainer.config.lora_r == 4
    probe = _batch(seed=7)
    base_model, _ = load_tiny_model(tiny_path)
    base_logp = _logp(base_model, probe)
    with trainer.policy.reference.scope():  # the KL reference: the policy with its adapter disabled
        assert torch.equal(_logp(peft_model, probe), base_logp), "the reference must be the base model exactly"
    start = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    assert (_logp(peft_model, probe) - base_logp).abs().mean() > 100 * TOL, "the adapter starts away from zero"
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in peft_model.parameters() if p.requires_grad} and all(".lora_" in n for n in start)

    trainer.train()
    for name, p in peft_model.get_base_model().named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, loaded[name.replace(".base_layer", "")]), f"base tensor {name} changed"
    assert all(not torch.equal(p, start[n]) for n, p in peft_model.named_parameters() if n in start), "adapter unchanged"
    # checkpoints: the adapter and its optimizer state, not the model
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / lora.ADAPTER_CONFIG).is_file() and not list(ckpt.glob("model*.safetensors"))
    saved = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file() and f.suffix != ".json")
    model_bytes = sum(t.numel() * 4 for t in loaded.values())
    assert saved < 0.5 * model_bytes, f"a LoRA checkpoint holds {saved} bytes against the model's {model_bytes}"
    # final/: an adapter peft loads, the same policy; merged/: a plain model computing the same
    final = tmp_path / "run" / "final"
    assert json.loads((final / lora.ADAPTER_CONFIG).read_text())["r"] == 4
    reloaded = PeftModel.from_pretrained(load_tiny_model(tiny_path)[0], str(final))
    trained_logp = _logp(peft_model, probe)
    assert torch.equal(_logp(reloaded, probe), trained_logp)
    merged, _ = load_tiny_model(str(final / "merged"))
    assert_close(_logp(merged, probe), trained_logp, atol=scaled(1e-5, trained_logp), rtol=1e-5, name="merged/")
    assert set(load_file(final / lora.ADAPTER_WEIGHTS)) == set(lora.adapter_tensors(peft_model))
    # `grpo-fast eval --model final/` evaluates the adapter on its base, no --use_peft needed
    evaluator = GRPOTrainer(config(tmp_path / "eval", model=str(final)), [target_fraction], rows(), evaluate_only=True)
    assert evaluator.config.use_peft and torch.equal(_logp(evaluator.model, probe), trained_logp)


def test_a_run_from_an_adapter_folder_trains_it_with_its_start_as_the_reference(tmp_path, tiny_path):
    start = lora.apply_lora(load_tiny_model(tiny_path)[0], config_for_peft(), peft_config=_peft_config(lora_dropout=0.05))
    start.peft_config["default"].base_model_name_or_path = tiny_path
    start.save_pretrained(tmp_path / "adapter")
    c = config(tmp_path, model=str(tmp_path / "adapter"), use_peft=True, beta=0.04, max_steps=1)
    trainer = GRPOTrainer(c, [target_fraction], rows())
    # the run's config takes the adapter's shape (r 4, not the default 16); dropout stays the run's (0, not TRL's 0.05)
    assert (trainer.config.lora_r, trainer.config.lora_alpha, trainer.config.lora_dropout) == (4, 8.0, 0.0)
    assert trainer.model.peft_config["default"].lora_dropout == 0.0
    probe = _batch(seed=8)
    start_logp, base_logp = _logp(start, probe), _logp(load_tiny_model(tiny_path)[0], probe)
    model = trainer.model
    assert torch.equal(_logp(model, probe), start_logp), "the run starts from the adapter"
    trainer.train()
    with trainer.policy.reference.scope():
        ref_logp = _logp(model, probe)
    assert torch.equal(ref_logp, start_logp), "the reference is the adapter the run started from"
    assert (ref_logp - base_logp).abs().mean() > 100 * TOL
    assert (_logp(model, probe) - start_logp).abs().mean() > TOL, "the trained adapter moved"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n in dict(model.named_parameters()) if ".lora_" in n and ".default." in n}


def test_a_lora_checkpoint_and_a_full_one_refuse_each_others_resume(tmp_path, tiny_path):
    for use_peft in (True, False):
        out = tmp_path / f"peft_{use_peft}"
        c = config(out, use_peft=use_peft, lora_r=4, max_steps=1, save_steps=1)
        GRPOTrainer(c, [target_fraction], rows(), model=load_tiny_model(tiny_path)[0],
                    tokenizer=load_tiny_model(tiny_path)[1]).train()
        other = config(out, use_peft=not use_peft, lora_r=4, max_steps=2, resume_from_checkpoint="latest")
        with pytest.raises(ValueError, match=rf"use_peft: {use_peft} -> {not use_peft}"):
            GRPOTrainer(other, [target_fraction], rows(), model=load_tiny_model(tiny_path)[0],
                        tokenizer=load_tiny_model(tiny_path)[1])


@pytest.mark.parametrize("overrides, message", [
    (dict(lora_r=0), r"GRPOConfig.lora_r=0 is invalid: expected an integer >= 1"),
    (dict(distributed_strategy="fsdp2"), r"distributed_strategy='fsdp2' is invalid: expected 'auto' or 'ddp' with use_peft"),
    (dict(lora_sync="adapter", lora_modules_to_save=["norm"]), r"lora_modules_to_save=\['norm'\] is invalid: expected None with lora_sync='adapter'"),
    (dict(use_peft=False, load_in_4bit=True), r"load_in_4bit=True is invalid: expected False without use_peft"),
    (dict(load_in_4bit=True, lora_sync="merged"), r"lora_sync='merged' is invalid: .* a 4-bit base cannot take merged"),
])
def test_lora_options_that_cannot_combine_are_refused_by_the_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**{"use_peft": True, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(lora_target_modules=["qkv"]), r"'qkv' names no linear layer of the model; its linear layers are "
                                        r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"),
    (dict(lora_target_modules=["q_proj", "lm_head"]), r"reaches the lm_head .* lora_modules_to_save may not name it"),
    (dict(lora_modules_to_save=["lm_head"]), r"lora_modules_to_save=\['lm_head'\] reaches the lm_head"),
    (dict(lora_modules_to_save=["norm"]), r"lora_modules_to_save=\['norm'\] is refused for a model with tied embeddings"),
    (dict(load_in_4bit=True), r"load_in_4bit=True \(a 4-bit QLoRA base\) needs bitsandbytes on a CUDA GPU"),
    (dict(lora_target_modules=["all-linear", "q_proj"]), r"'all-linear' stands alone"),
    (dict(lora_target_modules=[r".*\.qkv"]), r"qkv' names no linear layer"),  # (PEFT's regex form)
])
def test_lora_inputs_the_model_cannot_honour_are_refused_before_training(tmp_path, tiny_path, overrides, message):
    c = config(tmp_path, use_peft=True, **overrides)
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(c, [target_fraction], rows(), model=load_tiny_model(tiny_path)[0], tokenizer=load_tiny_model(tiny_path)[1])
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_an_adapter_folder_is_refused_without_use_peft_and_without_a_local_base(tmp_path, tiny_path):
    start = lora.apply_lora(load_tiny_model(tiny_path)[0], config_for_peft(), peft_config=_peft_config())
    start.peft_config["default"].base_model_name_or_path = "some-org/some-model"
    start.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"is a PEFT adapter folder: set use_peft=True"):
        GRPOTrainer(config(tmp_path, model=str(tmp_path / "adapter")), [target_fraction], rows())
    with pytest.raises(ValueError, match=r"base_model_name_or_path \('some-org/some-model'\) is not a local folder .* "
                                         r"--lora_base_model"):
        GRPOTrainer(config(tmp_path, model=str(tmp_path / "adapter"), use_peft=True), [target_fraction], rows())
    assert os.path.isdir(tiny_path)


@pytest.mark.parametrize("extra, message", [
    (dict(modules_to_save=["norm"]), r"lora_modules_to_save=\['norm'\] is refused for a model with tied embeddings"),
    (dict(use_dora=True), r"adapter_config.json\): use_dora and LoRA biases are not supported"),
])
def test_an_adapter_folder_gets_the_checks_a_new_adapter_gets(tmp_path, tiny_path, extra, message):
    start = lora.apply_lora(load_tiny_model(tiny_path)[0], config_for_peft(), peft_config=_peft_config())
    start.peft_config["default"].base_model_name_or_path = tiny_path
    start.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    (tmp_path / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps({**saved, **extra}))
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(config(tmp_path, model=str(tmp_path / "adapter"), use_peft=True), [target_fraction], rows())


def test_a_regex_target_adapts_the_layers_it_matches(tiny_path):
    model = lora.apply_lora(load_tiny_model(tiny_path)[0], config_for_peft(lora_target_modules=[r".*\.(q|v)_proj"]))
    assert {name.rsplit(".", 1)[-1] for name, _ in lora._lora_layers(model.get_base_model())} == {"q_proj", "v_proj"}


def test_an_adapter_base_is_the_default_model_by_its_name_only(tmp_path):
    for base, expected in [("HuggingFaceTB/SmolLM2-135M-Instruct", "default"), ("org/SmolLM2-135M-Instruct-sft", None)]:
        (tmp_path / lora.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": base}))
        if expected is None:
            with pytest.raises(ValueError, match="--lora_base_model"):
                lora.adapter_base(str(tmp_path), None)
        else:
            assert lora.adapter_base(str(tmp_path), None) == expected


def test_auto_strategy_is_ddp_for_an_adapter_where_the_full_model_would_be_sharded(tiny_path, monkeypatch):
    from grpo_fast.distributed import choose_strategy

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**12))  # a host whose share per rank holds no model
    full = load_tiny_model(tiny_path)[0]
    assert choose_strategy(full, "auto") == "fsdp2"
    assert choose_strategy(lora.apply_lora(full, config_for_peft(), peft_config=_peft_config()), "auto") == "ddp"


def test_a_peft_model_passed_in_is_trained_as_its_adapter(tmp_path, tiny_path):
    model, tokenizer = load_tiny_model(tiny_path)
    peft_model = lora.apply_lora(model, config_for_peft(), peft_config=_peft_config())
    trainer = GRPOTrainer(config(tmp_path), [target_fraction], rows(), model=peft_model, tokenizer=tokenizer)
    assert trainer.config.use_peft and trainer.config.lora_r == 4 and trainer.model is peft_model
    assert {n for group in trainer.optimizer.param_groups for p in group["params"]
            for n, q in peft_model.named_parameters() if q is p} == \
        {n for n, _ in peft_model.named_parameters() if ".lora_" in n}


def test_an_adapter_finds_its_own_base_from_another_folder_and_refuses_other_weights(tmp_path, tiny_path, monkeypatch):
    """Trained with a relative --model in one folder, evaluated from another folder that holds a same-named model
    with other weights (a decoy): the adapter records its base by absolute path and weights' sha256, so the eval
    uses its own base; a base with other weights at the recorded path is refused in one line before anything
    loads, and so is a resume of a LoRA checkpoint on it; one named by --lora_base_model is used with a warning
    (the same weights resharded or converted have other bytes: the user chose it)."""
    from grpo_fast import models
    from tests.tiny_model import build_tiny_model

    (tmp_path / "a").mkdir()
    os.symlink(tiny_path, tmp_path / "a" / "base")
    monkeypatch.chdir(tmp_path / "a")
    model = lora.apply_lora(load_tiny_model("base")[0], config_for_peft(), peft_config=_peft_config())
    lora.save_adapter(model, str(tmp_path / "a" / "final"))
    run = tmp_path / "a" / "run"
    lora.save_adapter(model, str(run / "checkpoint-1"))  # (a LoRA checkpoint's adapter, as training writes it)
    record = json.loads((tmp_path / "a" / "final" / lora.BASE_RECORD).read_text())
    assert record["path"] == os.path.realpath(tiny_path)
    decoy = build_tiny_model(tmp_path / "b" / "base", seed=1)  # the same config, other weights
    monkeypatch.chdir(tmp_path / "b")
    final = str(tmp_path / "a" / "final")
    assert lora.adapter_base(final, None) == os.path.realpath(tiny_path), "the adapter's own base, not ./base"
    evaluator = GRPOTrainer(config(tmp_path / "b", model=final), [target_fraction], rows(), evaluate_only=True)
    assert evaluator.model_path == os.path.realpath(tiny_path)
    with pytest.warns(UserWarning, match=r"lora_base_model=.*/b/base'.* are not those the adapter"):
        assert lora.adapter_base(final, decoy) == decoy
    # a resume of a LoRA checkpoint whose --model (relative, from another folder) names the decoy
    from grpo_fast.run import resume

    resumed = config(run, model="base", use_peft=True, resume_from_checkpoint="latest")
    monkeypatch.setattr(resume, "saved_config", lambda *a: (resumed.to_dict(), False))
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(ValueError, match=r"is a LoRA adapter trained on .* \(weights sha256 \w+\), but its base "
                                         r".*/b/base' holds other weights") as err:
        resume.check_run(resumed, str(run / "checkpoint-1"))
    assert len(str(err.value).splitlines()) == 1
    os.remove(tmp_path / "a" / "base")  # the recorded path now holds the decoy's weights
    os.symlink(decoy, tmp_path / "a" / "base")
    (tmp_path / "a" / "final" / lora.BASE_RECORD).write_text(json.dumps({**record, "path": str(tmp_path / "a" / "base")}))
    data = json.loads((tmp_path / "a" / "final" / lora.ADAPTER_CONFIG).read_text())
    (tmp_path / "a" / "final" / lora.ADAPTER_CONFIG).write_text(
        json.dumps({**data, "base_model_name_or_path": str(tmp_path / "a" / "base")}))
    with pytest.raises(ValueError, match=r"holds other weights"):
        lora.adapter_base(final, None)


@pytest.mark.parametrize("text", ["", " ", "q_proj,", "q_proj,,v_proj"])
def test_blank_lora_target_modules_are_refused_in_one_line_before_any_work(text, tmp_path, monkeypatch, capsys):
    from grpo_fast import models
    from grpo_fast.cli import main

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    assert main(["train", "--use_peft", "--lora_target_modules", text, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GRPOConfig.lora_target_modules=" in err and "without blank entries" in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"lora_modules_to_save=\['norm', None\] is invalid: expected None or module names"):
        config_for_peft(lora_modules_to_save=["norm", None])


def test_lora_dropout_says_once_what_it_implies():
    with pytest.warns(UserWarning, match=r"lora_dropout=0.05 with lora_sync='auto' \(the merged route\): the engine "
                                         r"samples the adapter without dropout \(merged into its weights\)"):
        config_for_peft(lora_dropout=0.05)

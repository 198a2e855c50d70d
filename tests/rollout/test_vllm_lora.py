"""The vLLM engine samples a live LoRA adapter by both routes (real CPU vLLM, the tiny model):

- merged: the targeted layers rewritten as W_base + s B A from the untouched base (a partial weight update);
- adapter: vLLM's LoRA path, each new A / B a new adapter version, the superseded one removed.

After every sync the engine's log-probs equal the trainer's and differ from the base's; a sync that never lands
stops the run; after 200 syncs of a bf16 engine nothing has drifted: the merged layers are bitwise
bf16(W_base + s B A) of the current A, B, every other tensor (and, by the adapter route, the base the engine
computes with) bitwise the loaded base, and the trainer's base and adapter are untouched by the syncs.
"""

import types

import pytest
import torch
from peft import LoraConfig

from grpo_fast.distributed import ONE_PROCESS, Parallel
from grpo_fast.generation.engines import make_engine
from grpo_fast.generation.engines.build import initial_sync
from grpo_fast.models import lora
from grpo_fast.train import sync
from grpo_fast.train.forward import Packer, completion_logprobs
from grpo_fast.trainer import GRPOTrainer
from tests.tiny_model import load_tiny_model
from tests.trainer.common import STOP_IDS, config, rows, target_fraction

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

PROBE = list(range(5, 45))
ROUTES = ("merged", "adapter")
TOLERANCE = sync.TOLERANCE[torch.float32]  # the sync probe's float32 bound


def _adapted(path):
    torch.manual_seed(0)
    model = load_tiny_model(path)[0]
    return lora.apply_lora(model, None, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                init_lora_weights=False))


def _engine(path, route, dtype, model):
    # block_size 32 (the CPU default is 128): the probe's 40 tokens fill a block, which the prefix cache keeps
    return make_engine("vllm", model_path=path, dtype=dtype, max_model_len=64, seed=0, block_size=32,
                       **({"lora": lora.spec(model)} if route == "adapter" else {}))


def _policy(model, route):
    """What the sync stage reads of `models.policy.Policy`."""
    return types.SimpleNamespace(model=model, lora_route=route, parallel=Parallel(model.get_base_model(), ONE_PROCESS),
                                 packer=Packer(model, max_tokens=64))


def _trainer_logp(model):
    return completion_logprobs(model, Packer(model, max_tokens=64), [PROBE[:1]], [PROBE[1:]], temperature=1.0,
                               backend="cpu")[0]


def _a_step(model, generator, scale=0.05):
    """What an optimizer step does to the adapter: A and B move."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(scale * torch.randn(p.shape, generator=generator))


@pytest.mark.parametrize("route", ROUTES)
def test_after_each_sync_the_engine_samples_the_trainers_adapter(tiny_model_dir, tiny_path, tmp_path, route):
    model = _adapted(tiny_model_dir)
    engine = _engine(tiny_model_dir, route, "float32", model)
    try:
        base = torch.tensor(engine.prompt_logprobs(PROBE))
        policy, g = _policy(model, route), torch.Generator().manual_seed(1)
        initial_sync(engine, model, route)
        for version in range(1, 4):
            _a_step(model, g)
            sync.sync_weights(engine, policy, shares_weights=False, version=version)
            engine_logp, trainer_logp = torch.tensor(engine.prompt_logprobs(PROBE)), _trainer_logp(model)
            gap = (engine_logp - trainer_logp).abs().mean().item()
            assert gap <= TOLERANCE, f"{route}: the engine differs from the trainer by {gap:.3g} after sync {version}"
            assert (engine_logp - base).abs().mean() > 100 * TOLERANCE, f"{route}: the engine still samples the base"
        # a sync under the version already loaded (a resumed run, the probe's retry): nothing the engine cached
        # for a prompt under the previous weights is reused (the prompt's sampled log-probs are the trainer's)
        engine.generate([PROBE], n=1, max_new_tokens=1, seed=0)  # (the prompt's blocks now cached)
        _a_step(model, g)
        sync.sync_weights(engine, policy, shares_weights=False, version=3)
        again = engine.generate([PROBE], n=1, max_new_tokens=8, seed=0)[0][0]
        trainer_logp = completion_logprobs(model, Packer(model, max_tokens=64), [PROBE], [again.token_ids],
                                           temperature=1.0, backend="cpu")[0]
        gap = (torch.tensor(again.logprobs) - trainer_logp).abs().mean().item()
        assert gap <= TOLERANCE, f"{route}: a prompt cached under the previous weights was reused ({gap:.3g})"
        # a sync that never lands: the probe sees it and, after one more try, stops the run
        _a_step(model, g)
        update = "update_weights" if route == "merged" else "update_adapter"
        setattr(engine, update, lambda *a, **k: None)
        part = types.SimpleNamespace(prompt_ids=[PROBE[:8]], completion_ids=[PROBE[8:]])
        with pytest.raises(RuntimeError, match="out of sync with the policy"):
            sync.check_engine_sync(engine, policy, part, world=ONE_PROCESS, shares_weights=False, backend="cpu", step=4)
        delattr(engine, update)
        # the trainer on this engine: every step's probe within the float32 bound, the base untouched. The adapter
        # route trains with partial rollouts: completions carried into the next round are continued under the
        # next adapter version, their tokens at most one version stale
        base_model, tokenizer = load_tiny_model(tiny_path)
        loaded = {n: p.detach().clone() for n, p in base_model.named_parameters()}
        partial = route == "adapter"
        overrides = dict(max_steps=3, max_staleness=1, rollout_overprovision=1.0, num_generations=4,
                         per_device_train_batch_size=8, max_completion_length=24, eval_before_train=False) \
            if partial else dict(max_steps=2)
        if partial:  # some completions finish early, others run to the budget and carry over
            base_model.generation_config.eos_token_id = STOP_IDS
        trainer = GRPOTrainer(config(tmp_path, engine="vllm", lora_sync=route, **overrides), [target_fraction], rows(),
                              model=base_model, tokenizer=tokenizer, engine=engine,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        trainer.train()
        lines = _metrics(tmp_path / "run")
        diffs = [r["sampling/sync_check_diff"] for r in lines if "sampling/sync_check_diff" in r]
        assert len(diffs) == overrides["max_steps"] and max(diffs) <= TOLERANCE, diffs
        if partial:
            steps = [r for r in lines if "rollout/carried_over" in r]
            assert sum(r["rollout/carried_over"] for r in steps) > 0, steps
            assert max(r["rollout/staleness_max"] for r in steps) == 1, steps
        for name, p in trainer.model.get_base_model().named_parameters():
            if ".lora_" not in name:
                assert torch.equal(p, loaded[name.replace(".base_layer", "")]), name
    finally:
        engine.close()


def _metrics(run):
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# vLLM's Llama fuses q/k/v and gate/up: its layer -> the HF tensors it stacks
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _expected(vllm_name: str, hf: dict) -> torch.Tensor:
    layer, _, param = vllm_name.rpartition(".")
    prefix, _, kind = layer.rpartition(".")
    if kind in _FUSED:
        return torch.cat([hf[f"{prefix}.{part}.{param}"] for part in _FUSED[kind]])
    return hf[vllm_name]


def _merged_by_hand(base: dict, adapter: dict, scaling: float) -> dict:
    """{HF name: bf16(W_base + s B A)} for the adapted layers (float32 arithmetic), the base in bf16 elsewhere."""
    out = {}
    for name, w in base.items():
        key = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{key}.lora_A.weight" in adapter:
            a, b = adapter[f"{key}.lora_A.weight"].float(), adapter[f"{key}.lora_B.weight"].float()
            w = w.float() + scaling * (b @ a)
        out[name] = w.to(torch.bfloat16)
    return out


def _engine_tensors(engine) -> dict:
    """{vLLM name: tensor} of the CPU engine: the kept checkpoint-format tensors its packed layers are made
    from, and the plain parameters of the others (norms)."""
    names = {id(m): n.replace(".base_layer", "") for n, m in engine.model.named_modules()}
    kept = {f"{names[id(layer)]}.{name}": t for (layer, name), t in engine._repack_targets.items()}
    plain = {n.replace(".base_layer", ""): p for n, p in engine.model.named_parameters() if "norm" in n}
    return {**kept, **plain}


@pytest.mark.parametrize("route", ROUTES)
def test_200_syncs_of_a_bf16_engine_leave_no_drift(tiny_model_dir, route):
    model = _adapted(tiny_model_dir)
    base = {n: t.clone() for n, t in lora.engine_weights(model, merged=False)}
    engine = _engine(tiny_model_dir, route, "bfloat16", model)
    try:
        base_logp = engine.prompt_logprobs(PROBE)  # the loaded base computing, before any adapter
        policy, g = _policy(model, route), torch.Generator().manual_seed(2)
        initial_sync(engine, model, route)
        for version in range(1, 201):
            _a_step(model, g, scale=0.01)
            sync.sync_weights(engine, policy, shares_weights=False, version=version)
            if version % 50 == 0:
                engine.prompt_logprobs(PROBE)  # (the adapter route loads an adapter into its slot at a request)
        adapter = {n: t.clone() for n, t in lora.adapter_tensors(model).items()}
        for name, t in lora.engine_weights(model, merged=False):
            assert torch.equal(t, base[name]), f"the trainer's base tensor {name} changed"
        if route == "merged":
            merged = _merged_by_hand(base, adapter, scaling=8 / 4)
            loaded = {n: t.to(torch.bfloat16) for n, t in base.items()}
            targeted = {n for n, _ in lora.engine_weights(model, merged=True, only_adapted=True)}
            assert targeted == {n for n in merged if not torch.equal(merged[n], loaded[n])}
            tensors = _engine_tensors(engine)
            assert any(".qkv_proj." in n for n in tensors) and any("norm" in n for n in tensors)
            for name, tensor in tensors.items():
                parts = [f"{name.rpartition('.')[0].rpartition('.')[0]}.{p}.weight" for p in _FUSED.get(
                    name.rpartition(".")[0].rpartition(".")[2], ())] or [name]
                if all(p in targeted for p in parts):
                    assert torch.equal(tensor, _expected(name, merged)), f"{name} is not bf16(W_base + s B A)"
                else:
                    assert torch.equal(tensor, _expected(name, loaded)), f"{name} is not the loaded base"
        else:
            assert engine.adapters() and len(engine.adapters()) == 1, engine.adapters()
            current, engine._adapter = engine._adapter, None
            assert engine.prompt_logprobs(PROBE) == base_logp, "the engine's base computes otherwise than when loaded"
            engine._adapter = current
        after = lora.adapter_tensors(model)  # the syncs left the trainer's adapter as it was (vLLM scales a copy)
        assert all(torch.equal(after[n], adapter[n]) for n in adapter)
    finally:
        engine.close()

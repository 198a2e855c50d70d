"""Routing replay (grpo_fast/models/routing.py) on tiny random MoE models: replaying a model's own routing is its own
forward (values and router gradients), a replayed forward hands the experts the recorded ids, the HF engine records
what the model routes, vLLM's output format (a fixture shaped like its CompletionOutput) becomes the same record, and
what cannot be replayed is refused by name."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_fast.config import GRPOConfig
from grpo_fast.models import routing
from grpo_fast.train.forward import Packer, completion_hidden, policy_parts
from tests.helpers import assert_close, scaled

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 30, 31, 32]]
COMPLETIONS = [[11, 12, 13], [20, 21, 22, 23, 24], [40, 41]]


def tiny_moe(model_type: str = "qwen3_moe", seed: int = 0, vocab_size: int = 320):
    """A random 2-layer, 4-expert, top-2 causal LM of `model_type` (fp32), in memory."""
    import transformers

    shapes = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    families = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32,
                                                                     intermediate_size=64, norm_topk_prob=True)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32)),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, intermediate_size=32,
                                                               layer_types=["full_attention"] * 2)),
    }
    config_class, model_class, extra = families[model_type]
    config = getattr(transformers, config_class)(**shapes, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config).float()
        for _, router in routing.routers(model):  # (some families start their routers at zero: all experts tie)
            torch.nn.init.normal_(router.weight, std=0.5)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.eval()


@pytest.fixture(scope="module")
def qwen3_moe():
    return tiny_moe("qwen3_moe")


def own_routing(model, mb) -> list[torch.Tensor]:
    """Per sample of `mb`, the experts its completion positions are routed to by the model itself, as a record."""
    base = policy_parts(model)[0]
    seen = {}
    hooks = [router.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out[2]))
             for layer, router in routing.routers(base)]
    try:
        with torch.no_grad():
            completion_hidden(base, mb)
    finally:
        for hook in hooks:
            hook.remove()
    lengths = mb.completion_mask.sum(dim=1).tolist()
    records = [None] * (max(mb.rows) + 1)
    for j, (i, n) in enumerate(zip(mb.rows, lengths, strict=True)):
        positions = mb.hidden_index[j, :n]
        records[i] = torch.stack([seen[layer][positions] for layer in sorted(seen)], dim=1).to(torch.int16)
    return records


def forward_and_router_grads(model, mb):
    """(completion hidden states, the routers' weight gradients of their sum) with mb's routing (if any) replayed."""
    base = policy_parts(model)[0]
    model.zero_grad(set_to_none=True)
    with routing.replaying(base, mb.routing):
        hidden = completion_hidden(base, mb)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
    return hidden.detach(), [router.weight.grad.clone() for _, router in routing.routers(base)]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_replaying_its_own_routing_is_the_models_own_forward(model_type, qwen3_moe):
    model = qwen3_moe if model_type == "qwen3_moe" else tiny_moe(model_type)
    packer = Packer(model, 256, routing_replay=True)
    (plain,) = packer.micro_batches(PROMPTS, COMPLETIONS)
    records = own_routing(model, plain)
    (replayed,) = packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records)
    hidden, grads = forward_and_router_grads(model, plain)
    hidden_r, grads_r = forward_and_router_grads(model, replayed)
    assert_close(hidden_r, hidden, atol=scaled(1e-6, hidden), rtol=1e-6, name=f"{model_type} hidden states")
    for layer, (g_r, g) in enumerate(zip(grads_r, grads, strict=True)):
        assert float(g.abs().max()) > 0, f"{model_type}: layer {layer}'s router gets no gradient"
        assert_close(g_r, g, atol=scaled(1e-6, g), rtol=1e-5, name=f"{model_type} router {layer} gradient")
    tokens, used, own = replayed.routing.counts()
    assert (tokens, used, own) == (sum(map(len, COMPLETIONS)), 0, 0)
    # and the model's own logits: the packed, replayed forward's at each completion position
    weight = policy_parts(model)[1]
    for j, i in enumerate(replayed.rows):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPTS[i] + COMPLETIONS[i][:-1]])).logits[0, len(PROMPTS[i]) - 1 :]
        mine = hidden_r[j, : len(COMPLETIONS[i])] @ weight.detach().T
        assert_close(mine, logits, atol=scaled(1e-5, logits), rtol=1e-5, name=f"{model_type} logits of sample {i}")


def test_replay_hands_the_experts_the_recorded_ids(qwen3_moe):
    model = qwen3_moe
    base = policy_parts(model)[0]
    packer = Packer(model, 256, routing_replay=True)
    (plain,) = packer.micro_batches(PROMPTS, COMPLETIONS)
    own = own_routing(model, plain)
    generator = torch.Generator().manual_seed(0)
    records = [torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(len(c) * 2)])
               .view(len(c), 2, 2).to(torch.int16) for c in COMPLETIONS]
    (mb,) = packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records)
    given = {}  # layer -> the expert ids its experts module was called with
    experts = [(layer, router_layer_experts(base, layer)) for layer, _ in routing.routers(base)]
    hooks = [module.register_forward_pre_hook(lambda m, args, layer=layer: given.__setitem__(layer, args[1]))
             for layer, module in experts]
    try:
        _, grads = forward_and_router_grads(model, mb)
    finally:
        for hook in hooks:
            hook.remove()
    routed_as_recorded = 0
    for j, i in enumerate(mb.rows):
        positions = mb.hidden_index[j, : len(COMPLETIONS[i])]
        for layer in given:
            assert torch.equal(given[layer][positions].sort(-1).values, records[i][:, layer].long().sort(-1).values)
        routed_as_recorded += len(positions)
    assert routed_as_recorded == sum(map(len, COMPLETIONS))  # every generated token, counted
    assert all(float(g.abs().max()) > 0 for g in grads)  # the mixing weights of the replayed experts carry gradient
    tokens, used, differs = mb.routing.counts()
    expected_own = sum(int((torch.stack([own[i][:, layer].long().sort(-1).values != records[i][:, layer].long().sort(-1).values
                                         for layer in range(2)]).any(-1).any(0)).sum()) for i in range(len(COMPLETIONS)))
    assert (tokens, used, differs) == (routed_as_recorded, 0, expected_own) and differs > 0
    # measuring without replaying: the model keeps its own routing, the disagreement is counted
    packer.routing_replay = False
    (measured,) = packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records)
    forward_and_router_grads(model, measured)
    assert measured.routing.counts() == [routed_as_recorded, expected_own, expected_own]
    assert routing.metrics(routing.counts([measured.routing, None]))["routing/disagreement"] == expected_own / routed_as_recorded


def router_layer_experts(base, layer: int):
    return base.layers[layer].mlp.experts


def test_a_record_of_the_wrong_length_is_refused(qwen3_moe):
    packer = Packer(qwen3_moe, 256, routing_replay=True)
    records = [torch.zeros(len(c) + (i == 1), 2, 2, dtype=torch.int16) for i, c in enumerate(COMPLETIONS)]
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has shape \(6, 2, 2\): expected \(5, layers, top_k\)"):
        list(packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records))


def test_the_hf_engine_records_what_the_model_routes(qwen3_moe):
    from grpo_fast.generation.engines.hf_engine import HFEngine
    from tests.tiny_model import build_tiny_tokenizer

    engine = HFEngine(qwen3_moe, build_tiny_tokenizer(), record_routing=True)
    groups = engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=0, stop_token_ids=list(range(200, 320)))
    completions = [c for g in groups for c in g]
    prompts = [p for p in PROMPTS for _ in range(2)]
    assert all(c.routed_experts.shape == (len(c.token_ids), 2, 2) and c.routed_experts.dtype == torch.int16
               for c in completions)
    assert len({len(c.token_ids) for c in completions}) > 1  # rows cut at their own ends
    (mb,) = Packer(qwen3_moe, 256).micro_batches(prompts, [c.token_ids for c in completions])
    own = own_routing(qwen3_moe, mb)
    for i, c in enumerate(completions):  # (same weights: the engine's steps route as the packed forward does)
        assert torch.equal(c.routed_experts.long().sort(-1).values, own[i].long().sort(-1).values), f"completion {i}"
    ((plain,),) = HFEngine(qwen3_moe, engine.tokenizer).generate([PROMPTS[0]], n=1, max_new_tokens=3, seed=0)
    assert plain.routed_experts is None


def test_what_cannot_be_replayed_is_refused(tiny):
    from grpo_fast.generation.engines.hf_engine import HFEngine

    llama, tokenizer = tiny
    with pytest.raises(ValueError, match="got model type 'llama'"):
        HFEngine(llama, tokenizer, record_routing=True)
    with pytest.raises(ValueError, match="got model type 'deepseek_v3'"):
        routing.check_replayable(SimpleNamespace(config=SimpleNamespace(model_type="deepseek_v3")))
    with pytest.raises(ValueError, match="records each token's experts"):
        routing.check_engine(HFEngine(llama, tokenizer))
    for fields, refusal in [
        (dict(max_staleness=1, engine="vllm"), r"max_staleness=1 is invalid: expected 0 with routing_replay=True"),
        (dict(rollout_mode="early_exit", num_generations=4, early_exit_points=3),
         r"rollout_mode='early_exit' is invalid: expected 'parallel' with routing_replay=True"),
    ]:
        with pytest.raises(ValueError, match=refusal):
            GRPOConfig(routing_replay=True, **fields)


# ---- vLLM: written against its API, checked on a fixture of its output (its Model Runner V2 cannot start here) ----


def vllm_completion_output(token_ids, routed_experts):
    """Shaped like vllm.outputs.CompletionOutput (0.32) of a finished request: its sampled token ids, a per-step
    {token: Logprob} dict, and `routed_experts`, numpy [rows, num_hidden_layers, top_k] in uint8 (<= 256 experts)."""
    return SimpleNamespace(index=0, text="", token_ids=list(token_ids), cumulative_logprob=None,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=None)} for t in token_ids],
                           routed_experts=routed_experts, finish_reason="stop", stop_reason=None)


def test_vllm_routed_experts_become_the_record():
    from grpo_fast.generation.engines import vllm_engine
    from tests.tiny_model import build_tiny_tokenizer

    rng = np.random.default_rng(0)
    routed = rng.integers(0, 128, size=(4, 3, 2)).astype(np.uint8)  # 4 completion tokens, 3 layers, top-2
    completion = vllm_engine.VLLMEngine._completion(vllm_completion_output([5, 6, 7, 2], routed), build_tiny_tokenizer(),
                                                   records_routing=True)
    assert completion.routed_experts.dtype == torch.int16
    assert torch.equal(completion.routed_experts, torch.from_numpy(routed.astype(np.int16)))
    assert vllm_engine.VLLMEngine._completion(vllm_completion_output([5, 2], routed[:2]), build_tiny_tokenizer()).routed_experts is None
    with pytest.raises(RuntimeError, match=r"shape \(4, 3, 2\): expected \(3, layers, top_k\)"):
        vllm_engine.VLLMEngine._completion(vllm_completion_output([5, 6, 2], routed), build_tiny_tokenizer(), True)
    with pytest.raises(RuntimeError, match="returned no routed_experts"):
        vllm_engine.VLLMEngine._completion(vllm_completion_output([5, 2], None), build_tiny_tokenizer(), True)
    # the request asks for the rows from the prompt's last token on; the engine for the capture
    assert vllm_engine._routing_params(True, [1, 5, 6]) == {"routed_experts_prompt_start": 2}
    assert vllm_engine._routing_params(False, [1, 5, 6]) == {}
    assert vllm_engine._routing_kwargs(True) == {"enable_return_routed_experts": True}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_the_installed_vllm_has_the_routing_api_written_against():
    """The names the engine uses, read in the installed vLLM's sources (importing vLLM costs ~12 s here)."""
    root = importlib.util.find_spec("vllm").submodule_search_locations[0]

    def source(path):
        with open(os.path.join(root, path)) as f:
            return f.read()

    assert "routed_experts: np.ndarray | None = None  # [seq_len,layer_num,topk]" in source("outputs.py")
    assert "routed_experts_prompt_start: int = 0" in source("sampling_params.py")
    assert "enable_return_routed_experts: bool = False" in source("engine/arg_utils.py")


def test_replay_holds_through_gradient_checkpointings_recompute():
    """The backward recomputes each layer (its routers included) while `replaying` is still open: the gradients are
    those of the replayed forward without checkpointing."""
    model = tiny_moe("qwen3_moe", seed=1).train()
    packer = Packer(model, 256, routing_replay=True)
    records = [torch.tensor([[[3, 1], [0, 2]]] * len(c), dtype=torch.int16) for c in COMPLETIONS]
    (mb,) = packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records)
    hidden, grads = forward_and_router_grads(model, mb)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (mb,) = packer.micro_batches(PROMPTS, COMPLETIONS, routed_experts=records)
    hidden_c, grads_c = forward_and_router_grads(model, mb)
    assert_close(hidden_c, hidden, atol=scaled(1e-6, hidden), rtol=1e-6, name="hidden states")
    for layer, (g_c, g) in enumerate(zip(grads_c, grads, strict=True)):
        assert_close(g_c, g, atol=scaled(1e-6, g), rtol=1e-5, name=f"router {layer} gradient under checkpointing")
    assert mb.routing.counts()[1] == 0

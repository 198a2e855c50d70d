"""TRL's method contracts under the backend: each trl.GRPOTrainer method FastGRPOTrainer overrides returns what stock
TRL 1.16 returns (None-ness, shapes, dtypes, requires_grad, and values) so a subclass that calls it keeps working,
and a backend refusal never hides the error stock TRL raises first."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, scaled

from .conftest import grpo_config, length_reward

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def pair(tiny_path, prompts, tmp_path_factory):
    """(stock, fast) on the same tiny Llama, entropy bonus on (entropy_coef != 0), in train mode."""
    out = tmp_path_factory.mktemp("contracts")
    trainers = [cls(model=tiny_path, reward_funcs=length_reward, args=grpo_config(out, entropy_coef=0.1),
                    train_dataset=prompts) for cls in (GRPOTrainer, FastGRPOTrainer)]
    for trainer in trainers:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # (set by Trainer's loop)
    return trainers


def _batch():
    """Two rows, 4 prompt + 3 completion tokens; the second row's last completion token is padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    return ids, mask, 3


def _same_contract(stock_out, fast_out, what):
    assert len(stock_out) == len(fast_out) == 3, what
    for index, (s, f) in enumerate(zip(stock_out, fast_out, strict=True)):
        name = f"{what}[{index}]"
        assert (s is None) == (f is None), f"{name}: stock returns {s!r:.40}, the backend {f!r:.40}"
        if s is None:
            continue
        assert (f.shape, f.dtype, f.requires_grad) == (s.shape, s.dtype, s.requires_grad), name
        assert_close(f.detach(), s.detach(), atol=scaled(1e-5, s.detach()), rtol=1e-5, name=name)


@pytest.mark.parametrize("compute_entropy", [False, True])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_logps_and_entropies_return_what_stock_returns(pair, compute_entropy, grad):
    """`_get_per_token_logps_and_entropies`, in row chunks (batch_size=1) as TRL's passes call it."""
    ids, mask, keep = _batch()
    with torch.set_grad_enabled(grad):
        outs = [t._get_per_token_logps_and_entropies(t.model, ids, mask, keep, batch_size=1,
                                                     compute_entropy=compute_entropy) for t in pair]
    _same_contract(*outs, what=f"_get_per_token_logps_and_entropies(compute_entropy={compute_entropy})")


def test_entropies_carry_the_gradient_stock_does(pair):
    """With entropy_coef != 0 the entropies the method returns are differentiable, and their gradient is stock's
    (TRL's test_entropy_bonus_flows_gradients asks the first; a subclass adding its own entropy term needs both)."""
    ids, mask, keep = _batch()
    grads = []
    for trainer in pair:
        assert trainer._entropy_bonus_enabled
        trainer.model.zero_grad(set_to_none=True)
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                                     compute_entropy=True)
        assert entropies.requires_grad, f"{type(trainer).__name__}: entropies without a gradient"
        (entropies * mask[:, -keep:]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    stock, fast = grads
    assert fast.keys() == stock.keys() and stock
    scale = max(g.abs().max().item() for g in stock.values())
    assert scale > 0, "the entropy has no gradient in stock TRL either: nothing compared"
    for name in stock:
        assert_close(fast[name], stock[name], atol=1e-5 * scale, rtol=1e-4, name=f"d entropy / d {name}")


def test_compute_loss_returns_what_stock_returns(pair):
    """`compute_loss` (and so `_compute_loss`): a 0-dim loss of stock's dtype, differentiable in training and not
    under no_grad (evaluation), equal to stock's; return_outputs=True refused with stock's message."""
    ids, mask, keep = _batch()
    inputs = dict(prompt_ids=ids[:, :-keep], prompt_mask=mask[:, :-keep], completion_ids=ids[:, -keep:],
                  completion_mask=mask[:, -keep:], advantages=torch.tensor([0.5, -0.5]),
                  num_items_in_batch=mask[:, -keep:].sum())
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            stock, fast = (t.compute_loss(t.model, inputs) for t in pair)
        assert (fast.shape, fast.dtype, fast.requires_grad) == (stock.shape, stock.dtype, stock.requires_grad), grad
        assert_close(fast.detach(), stock.detach(), atol=scaled(1e-5, stock.detach()), rtol=1e-5, name="loss")
    messages = []
    for trainer in pair:
        with pytest.raises(ValueError) as refused:
            trainer.compute_loss(trainer.model, inputs, return_outputs=True)
        messages.append(str(refused.value))
    assert messages[0] == messages[1]


def test_trl_validation_comes_before_the_backend_refusals(tiny_path, tmp_path):
    """Arguments both TRL and the backend refuse (no train_dataset, and a delta the fused loss refuses): TRL's
    error, as stock TRL raises it."""
    args = grpo_config(tmp_path, delta=1.1)  # the backend refuses delta < 1 + epsilon_high
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        FastGRPOTrainer(model=tiny_path, reward_funcs=length_reward, args=args, train_dataset=None)


def test_unknown_environment_raises_trls_error_on_a_moe_model(tmp_path):
    """TRL's test_train_with_unknown_environment_raises, on a tiny Qwen3-MoE (router loss on, as TRL defaults):
    the backend builds the trainer and train() raises TRL's own error for an example naming no environment."""
    from datasets import Dataset
    from trl.chat_template_utils import qwen3_chat_template

    from tests.models.test_moe import tiny_moe
    from tests.tiny_model import build_tiny_tokenizer

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "model")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # a template TRL knows how to parse tool calls from
    tokenizer.save_pretrained(tmp_path / "model")

    class Counter:
        def reset(self, **kwargs):
            return None

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: Value to add.
            """
            return step

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "ab"}]] * 4, "environment": ["unknown"] * 4})
    trainer = FastGRPOTrainer(model=str(tmp_path / "model"), reward_funcs=length_reward,
                              args=grpo_config(tmp_path / "out", per_device_train_batch_size=4, num_generations=4),
                              train_dataset=dataset, environment_factory={"counter": Counter})
    assert trainer.aux_loss_enabled
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def test_qwen3_moe_with_tools_trains_like_stock(tmp_path):
    """TRL's test_train_with_tools on a tiny Qwen3-MoE (router loss on, as TRL defaults), stock and backend: the
    same scripted completions (a valid tool call, one with a wrong argument name, a plain answer; then "Done!"
    after each tool result), one step each, log the same tool metrics, loss, aux_loss and entropy."""
    from unittest.mock import patch

    from datasets import Dataset
    from trl.chat_template_utils import qwen3_chat_template

    from tests.models.test_moe import tiny_moe
    from tests.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # a template TRL parses tool calls from
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    call = '<tool_call>\n{{"name": "multiply_tool", "arguments": {{"a": 3, "{}": 4}}}}\n</tool_call>'
    scripted = {3: [ids(call.format("b")), ids(call.format("c")), ids("no tool")], 2: [ids("Done!")] * 2}

    def fake_generate(input_ids, **kwargs):
        rows = scripted[input_ids.shape[0]]
        width = max(map(len, rows))
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=1)

    def reward(completions, **kwargs):  # distinct per completion (conversational: the messages' text)
        return [float(len(str(c)) % 7) for c in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "ab"}]] * 3})
    logged = []
    for cls in (GRPOTrainer, FastGRPOTrainer):
        args = grpo_config(tmp_path / cls.__name__, per_device_train_batch_size=3, num_generations=3,
                           max_completion_length=128, max_steps=1, gradient_checkpointing=False)
        trainer = cls(model=str(tmp_path / "model"), reward_funcs=reward, args=args, train_dataset=dataset,
                      tools=[multiply_tool])
        assert trainer.aux_loss_enabled
        with patch.object(trainer.model, "generate", side_effect=fake_generate):
            trainer.train()
        logged.append(next(h for h in trainer.state.log_history if "loss" in h))
    stock, fast = logged
    assert fast["tools/call_frequency"] == pytest.approx(2 / 3)
    assert fast["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert stock["reward_std"] > 0, "equal rewards: zero advantages, the loss would be the router loss alone"
    for key in ("tools/call_frequency", "tools/failure_frequency", "loss", "aux_loss", "entropy"):
        assert_close(fast[key], stock[key], atol=scaled(1e-6, stock[key]), rtol=1e-5, name=key)


def test_peft_modules_to_save_lm_head_trains_like_stock(tiny_path, prompts, tmp_path):
    """PEFT's modules_to_save=["lm_head"] (a trained copy of the head, the workaround TRL's
    test_liger_kernel_with_peft_modules_to_save_lm_head_allowed builds): the backend reads the copy the wrapper
    runs, and computes stock's loss and gradients, the copy's included (it was refused as a non-Linear head)."""
    from peft import LoraConfig

    config = LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    stock, fast = (cls(model=tiny_path, reward_funcs=length_reward, args=grpo_config(tmp_path), train_dataset=prompts,
                       peft_config=config) for cls in (GRPOTrainer, FastGRPOTrainer))
    fast.model.load_state_dict(stock.model.state_dict())  # (the same LoRA initialisation)
    ids, mask, keep = _batch()
    inputs = dict(prompt_ids=ids[:, :-keep], prompt_mask=mask[:, :-keep], completion_ids=ids[:, -keep:],
                  completion_mask=mask[:, -keep:], advantages=torch.tensor([0.5, -0.5]),
                  num_items_in_batch=mask[:, -keep:].sum())
    results = []
    for trainer in (stock, fast):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}))
    (loss_s, grads_s), (loss_f, grads_f) = results
    assert_close(loss_f, loss_s, atol=scaled(1e-5, loss_s), rtol=1e-5, name="loss")
    head = [n for n in grads_s if "modules_to_save" in n]
    assert head and grads_s.keys() == grads_f.keys(), "the head's trained copy got no gradient"
    for name in grads_s:
        scale = grads_s[name].abs().max().item()
        assert_close(grads_f[name], grads_s[name], atol=1e-5 * scale + 1e-12, rtol=1e-4, name=f"grad {name}")

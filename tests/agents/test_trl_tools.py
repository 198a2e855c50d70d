"""TRL's own tool loop through the adapter: stock `trl.GRPOTrainer(tools=...)` builds with the tokenizer grpo_fast
ships for tools (its template and response parser), and FastGRPOTrainer with tools makes stock TRL's updates,
TRL logging tools/call_frequency > 0 (its tool_mask reaches the fused loss)."""

from __future__ import annotations

import pytest
import torch

from tests.agents.tool_model import TOOLS, tool_prompts
from tests.helpers import assert_close

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402
from tests.integrations.conftest import grpo_config  # noqa: E402


def answer_reward(completions, answer, **kwargs):
    """The right answer, plus a little per character written (the completions of a group differ)."""
    return [float(c[-1]["content"].strip() == a) + 0.01 * sum(len(str(m.get("content", ""))) for m in c)
            for c, a in zip(completions, answer, strict=True)]


def _train(cls, model_dir, out):
    from datasets import Dataset

    rows = tool_prompts(8, seed=3)
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    args = grpo_config(out, max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=160,
                       optim="sgd", learning_rate=0.01, lr_scheduler_type="constant", max_tool_calling_iterations=3,
                       temperature=1.2)  # (the tiny model is sure of its script: at 1 a group samples alike)
    trainer = cls(model=model_dir, reward_funcs=answer_reward, args=args, train_dataset=data, tools=TOOLS)
    trainer.train()
    return trainer


def test_fast_trainer_with_tools_makes_stock_trl_updates(tool_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32).state_dict()
    stock = _train(GRPOTrainer, tool_model_dir, tmp_path / "stock")
    assert stock.processing_class.response_template is not None  # the shipped parser, read by TRL
    fast = _train(FastGRPOTrainer, tool_model_dir, tmp_path / "fast")
    logs_stock = [h for h in stock.state.log_history if "loss" in h]
    logs_fast = [h for h in fast.state.log_history if "loss" in h]
    assert len(logs_stock) == len(logs_fast) == 2
    assert all(h["tools/call_frequency"] > 0 for h in logs_fast), logs_fast
    for h_fast, h_stock in zip(logs_fast, logs_stock, strict=True):
        assert h_fast["tools/call_frequency"] == h_stock["tools/call_frequency"]
        assert_close(h_fast["loss"], h_stock["loss"], atol=1e-5, rtol=1e-4, name="loss")
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in stock.model.named_parameters())
    assert moved > 1e-4, f"training barely moved the weights ({moved:.2g}): the comparison would prove nothing"
    for name, p_stock in stock.model.named_parameters():
        p_fast = dict(fast.model.named_parameters())[name]
        assert_close(p_fast, p_stock, atol=1e-5, rtol=1e-5, name=f"weight {name}")


def test_stock_trl_builds_with_the_shipped_tokenizer(tmp_path):
    """SmolLM2's tokenizer with grpo_fast's tool template and response parser (saved, then loaded as a user would):
    stock TRL keeps the template (prefix-preserving), uses the parser, and renders the tools."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from grpo_fast.generation.agents.builtin import calculator
    from grpo_fast.generation.agents.chat import TOOL_CHAT_TEMPLATE, ChatTemplate
    from grpo_fast.generation.agents.tools import as_tools
    from grpo_fast.models.loading import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    ChatTemplate(tokenizer, as_tools([calculator]))
    tokenizer.save_pretrained(tmp_path / "tok")
    shipped = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert shipped.chat_template == TOOL_CHAT_TEMPLATE and shipped.response_template is not None
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 2 + 3?"}]] * 4})
    args = grpo_config(tmp_path / "run", max_steps=1, per_device_train_batch_size=4, num_generations=4)
    trainer = GRPOTrainer(model=default_model_path(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=data, processing_class=shipped, tools=[calculator])
    assert trainer.chat_template is None  # TRL found it prefix-preserving: kept, not replaced by its training template
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>'
    parsed = trainer.processing_class.parse_response(text, prefix="<|im_start|>assistant\n")
    assert parsed["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 + 3"}}

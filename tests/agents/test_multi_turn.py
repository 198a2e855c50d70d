"""Multi-turn trajectories with the real engines and the tiny model made to call tools: tools executed (every
test asserts calls and a trajectory of >= 3 turns where it samples freely), tool tokens masked out of the loss
and the IS metrics, the vLLM engine never waiting for a tool, bad tools costing one counted failure each, and
a few training steps with each engine."""

import json
import math
import os
import threading
import time

import pytest
import torch

from grpo_fast.config import GRPOConfig
from grpo_fast.generation.agents import AgentOptions, build_agent
from grpo_fast.generation.agents.loop import MALFORMED, AgentLoop, LoopOptions, Trajectory
from grpo_fast.generation.batch import Rollouts
from grpo_fast.generation.engines import vllm_available
from grpo_fast.generation.engines.base import SamplingOptions, hashed_seed
from grpo_fast.train.logprobs import sampling_stats
from grpo_fast.train.step import LossOptions, train_step
from grpo_fast.trainer import GRPOTrainer
from tests.agents import tool_model
from tests.agents.tool_model import TOOL_NAMES, TOOLS, mul, right_answer, tool_prompts
from tests.trainer.test_step import CaptureGrads


def _config(tmp_path, model_dir, **overrides):
    fields = dict(model=model_dir, tools=TOOL_NAMES, reward_funcs=["right_answer"], num_generations=4,
                  per_device_train_batch_size=8, max_prompt_length=64, max_completion_length=200,
                  max_tokens_per_microbatch=2048, learning_rate=1e-4, max_steps=2, engine="hf",
                  output_dir=str(tmp_path / "run"), disable_tqdm=True, eval_max_samples=4, eval_steps=0,
                  mixed_precision="no", vllm_dtype="float32", eval_before_train=False, save_final=False)
    fields.update(overrides)
    return GRPOConfig(**fields)


def _trainer(tmp_path, model_dir, **overrides):
    return GRPOTrainer(_config(tmp_path, model_dir, **overrides), [right_answer], tool_prompts(24), tool_prompts(4, 1))


def _run(trainer, tools=None, n=8, *, temperature=1.0, max_completion_length=200, iterations=None, timeout=30.0,
         response_tokens=256) -> tuple[list[Trajectory], AgentLoop]:
    """n trajectories of the run's first prompts through the loop, with `tools` (default: the script's)."""
    agent = build_agent(tools or TOOLS, trainer.tokenizer, AgentOptions.from_config(trainer.config, tool_timeout=timeout))
    loop = AgentLoop(trainer.engine, trainer.tokenizer, agent.chat, agent.runner, LoopOptions(
        max_completion_length=max_completion_length, max_tool_calling_iterations=iterations,
        max_tool_response_tokens=response_tokens, sampling=SamplingOptions(temperature=temperature)))
    trajectories = [Trajectory(prompt_ids=list(trainer.train_prompt_ids[i % 4]), seed=hashed_seed(7, i)) for i in range(n)]
    return loop.run(trajectories), loop


def _assert_tools_ran(trajectories):
    assert sum(t.calls for t in trajectories) >= 1, "no tool was called"
    assert max(t.turns for t in trajectories) >= 3, f"no trajectory ran 3 turns: {[t.turns for t in trajectories]}"


def _assert_bookkeeping(trajectories, max_completion_length):
    for t in trajectories:
        assert len(t.ids) == len(t.logp) == len(t.mask) <= max_completion_length
        logp = torch.tensor(t.logp)
        mask = torch.tensor(t.mask)
        assert torch.isfinite(logp[mask]).all(), "a model token without its sampling log-prob"
        assert logp[~mask].isnan().all(), "a tool token with a sampling log-prob"
        assert t.mask[-1], "a trajectory ends with the model's turn, never a tool result"


# ---- the HF engine: lock-step turns ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_trainer(tool_model_dir, tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("hf"), tool_model_dir)


def test_hf_trajectories_call_tools_and_mask_them(hf_trainer):
    trajectories, loop = _run(hf_trainer)
    _assert_tools_ran(trajectories)
    _assert_bookkeeping(trajectories, 200)
    three = next(t for t in trajectories if t.turns >= 3)
    assert [m["role"] for m in three.messages][:4] == ["assistant", "tool", "assistant", "tool"]
    assert three.messages[1]["content"].endswith("(now mul)"), "the add tool ran on the model's arguments"


def test_budget_ends_a_trajectory_before_a_result_would_overflow_it(hf_trainer):
    trajectories, _ = _run(hf_trainer, max_completion_length=70)
    assert sum(t.calls for t in trajectories) >= 1
    _assert_bookkeeping(trajectories, 70)
    rolled_back = [t for t in trajectories if t.messages[-1].get("tool_calls") and t.finish_reason == "stop"]
    assert rolled_back, "no trajectory ended on a call whose result had no room"


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence"), ("dr_grpo", "token"),
                                              ("vespo", "token")])
def test_tool_tokens_change_no_gradient(hf_trainer, tool_model_dir, loss_type, level):
    """Trajectories cut right after their first tool result (so the result's tokens are the last ones): changing
    those tokens changes no gradient; changing one model token does (the test can fail)."""
    from tests.tiny_model import load_tiny_model

    trajectories, _ = _run(hf_trainer)
    _assert_tools_ran(trajectories)
    cut = []
    for t in trajectories:
        if t.rounds:
            end = t.mask.index(False)
            while end < len(t.mask) and not t.mask[end]:
                end += 1
            cut.append((t, end))
    assert len(cut) >= 2, "fewer than 2 trajectories called a tool"
    options = LossOptions(loss_type=loss_type, beta=0.0, importance_sampling_level=level, max_completion_length=200,
                          backend="cpu")

    def grads(change_tool: bool, change_model: bool):
        model, _ = load_tiny_model(tool_model_dir)
        model.train()
        completions, logp, masks = [], [], []
        for t, end in cut:
            ids = list(t.ids[:end])
            tool_positions = [k for k in range(end) if not t.mask[k]]
            if change_tool:
                for k in tool_positions:
                    ids[k] = (ids[k] * 7 + 11) % 300 + 3
            if change_model:
                ids[0] = (ids[0] + 1) % 300 + 3
            completions.append(ids)
            logp.append(torch.tensor(t.logp[:end]))
            masks.append(torch.tensor(t.mask[:end]))
        batch = Rollouts([t.prompt_ids for t, _ in cut], completions, logp, ["stop"] * len(cut), [""] * len(cut),
                         [{}] * len(cut), loss_mask=masks)
        batch.advantages = torch.linspace(-1, 1, len(cut))
        batch.old_logp = [torch.nan_to_num(x, nan=-1.0) - 0.01 for x in logp]  # (off-policy: ratios away from 1)
        batch.is_weights = [torch.where(m, 0.9, 5.0) for m in masks]  # (vespo folds them in; tool tokens' never count)
        optimizer = CaptureGrads(model)
        from grpo_fast.train.forward import Packer

        train_step(model, optimizer, Packer(model, max_tokens=4096), batch, options, max_grad_norm=0.0)
        return optimizer.grads

    base, tool_changed, model_changed = grads(False, False), grads(True, False), grads(False, True)
    for name, g in base.items():
        assert torch.equal(g, tool_changed[name]), f"changing tool-result tokens changed the gradient of {name}"
    assert any(not torch.equal(g, model_changed[name]) for name, g in base.items())


def test_is_metrics_ignore_tool_tokens(hf_trainer):
    trajectories, _ = _run(hf_trainer)
    _assert_tools_ran(trajectories)
    sampling = [torch.tensor(t.logp) for t in trajectories]
    trainer_logp = [torch.where(torch.tensor(t.mask), torch.tensor(t.logp) + 0.5, torch.tensor(-99.0))
                    for t in trajectories]  # model tokens 0.5 off, tool tokens wildly off (and NaN on the sampling side)
    stats = sampling_stats(trainer_logp, sampling)
    assert math.isclose(stats["sampling/logp_diff_mean"].value, 0.5, rel_tol=1e-5)
    assert math.isclose(stats["sampling/logp_diff_max"], 0.5, rel_tol=1e-5)


def test_hf_engine_trains_with_tools(tmp_path, tool_model_dir):
    trainer = _trainer(tmp_path, tool_model_dir)
    assert trainer.config.rollout_mode == "multi_turn"
    trainer.train()
    steps = _metrics(trainer)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["tools/call_frequency"] > 0 and r["tools/turns_mean"] > 1
        assert math.isfinite(r["loss"]) and r["completions/mean_length"] < 200
    assert any(r["grad_norm"] > 0 for r in steps), "no step had a gradient"


def _metrics(trainer) -> list[dict]:
    with open(os.path.join(trainer.config.output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"reward"' in line]


# ---- the vLLM engine: never waits for a tool ------------------------------------------------------------

vllm_only = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")


@pytest.fixture(scope="module")
def vllm_trainer(tool_model_dir, tmp_path_factory):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    return _trainer(tmp_path_factory.mktemp("vllm"), tool_model_dir, engine="vllm", sampling_check_steps=1,
                    vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")


def _first_call_only(behaviour):
    """The script's add, but its first call of the run returns `behaviour(a, b)` instead (sleep first, hang, raise,
    answer at length); the other trajectories go on, so the run still has trajectories of 3 turns."""
    lock, calls = threading.Lock(), []

    def add(a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        with lock:
            calls.append(time.monotonic())
            first = len(calls) == 1
        return behaviour(a, b) if first else tool_model.add(a, b)

    return add


@vllm_only
def test_vllm_slow_tool_does_not_stall_the_others(vllm_trainer):
    def sleep_then_add(a, b):
        time.sleep(3)
        return tool_model.add(a, b)

    trajectories, loop = _run(vllm_trainer, [_first_call_only(sleep_then_add), mul])
    _assert_tools_ran(trajectories)
    _assert_bookkeeping(trajectories, 200)
    # the sleeper: the trajectory whose second turn came >= 3 s after its first
    sleeper = next(t for t in trajectories if len(t.turn_ends) >= 2 and t.turn_ends[1] - t.turn_ends[0] >= 3)
    start, end = sleeper.turn_ends[0], sleeper.turn_ends[0] + 3
    meanwhile = [e for t in trajectories if t is not sleeper for e in t.turn_ends if start < e < end]
    assert meanwhile, "no other trajectory finished a turn while one tool slept: the engine waited for it"
    assert loop.waiting_seconds < 3, f"the loop waited {loop.waiting_seconds:.1f} s with work to decode"


@vllm_only
def test_vllm_hanging_tool_times_out_and_the_run_ends(vllm_trainer):
    def hang(a, b):
        time.sleep(600)
        return "late"

    start = time.monotonic()
    trajectories, _ = _run(vllm_trainer, [_first_call_only(hang), mul], timeout=1.0)
    assert time.monotonic() - start < 60, "a tool sleeping 600 s held the run"
    _assert_tools_ran(trajectories)
    timed_out = [m for t in trajectories for m in t.messages if m["role"] == "tool"
                 and m["content"] == "error: tool 'add' did not return within tool_timeout=1 s"]
    assert len(timed_out) == 1 and sum(t.failures for t in trajectories) >= 1


@vllm_only
def test_vllm_raising_tool_and_an_oversized_result_are_counted(vllm_trainer):
    def boom(a, b):
        raise RuntimeError("add is broken")

    trajectories, _ = _run(vllm_trainer, [_first_call_only(boom), mul])
    _assert_tools_ran(trajectories)
    assert sum(t.failures for t in trajectories) >= 1
    assert any("add is broken" in m["content"] for t in trajectories for m in t.messages if m["role"] == "tool")

    trajectories, _ = _run(vllm_trainer, [_first_call_only(lambda a, b: "9" * 500 + " (now mul)"), mul], response_tokens=16)
    _assert_tools_ran(trajectories)
    assert sum(t.truncated for t in trajectories) == 1
    _assert_bookkeeping(trajectories, 200)


@vllm_only
def test_vllm_malformed_calls_are_answered_and_the_trajectory_goes_on(vllm_trainer):
    """The tiny model now and then writes call markup that does not parse (more so at temperature 1.2): each is
    answered with an error result, counted, and its trajectory continues with another turn."""
    trajectories, _ = _run(vllm_trainer, n=16, temperature=1.2)
    _assert_tools_ran(trajectories)
    assert sum(t.malformed for t in trajectories) >= 1
    answered = [t for t in trajectories if any(m["role"] == "tool" and m["name"] == "invalid_call" for m in t.messages)]
    assert answered and all(m["content"] == MALFORMED for t in answered for m in t.messages
                            if m["role"] == "tool" and m["name"] == "invalid_call")
    assert any(t.messages[-1]["role"] == "assistant" and t.turns >= 2 for t in answered)
    _assert_bookkeeping(trajectories, 200)


@vllm_only
def test_vllm_engine_trains_with_tools(vllm_trainer):
    vllm_trainer.train()
    steps = _metrics(vllm_trainer)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["tools/call_frequency"] > 0 and r["tools/turns_mean"] > 1 and r["tools/time_waiting"] >= 0
        assert math.isfinite(r["loss"])
        assert r["sampling/logp_diff_max"] < 1e-3, "the engine's log-probs of the model's tokens are the policy's"
    assert any(r["grad_norm"] > 0 for r in steps), "no step had a gradient"

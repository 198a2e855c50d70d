"""The GRPO variants' rollout modes (grpo_fast/generation/modes/early_exit.py, multi_answer.py) on a real engine and the tiny
model: group shapes, the injected text masked, the shared thought prefix, thoughts ended at
thought_end. `check_early_exit` / `check_multi_answer` run here on HFEngine and in
test_vllm_engine.py on vLLM.
"""

import itertools
import math

import pytest
import torch

from grpo_fast.config import GRPOConfig
from grpo_fast.generation.engines.base import SamplingOptions
from grpo_fast.generation.engines.hf_engine import HFEngine
from grpo_fast.generation.modes import early_exit, multi_answer

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
ROWS = [{"prompt": "a"}, {"prompt": "b"}]
THOUGHT_END = "<t"  # the start of every filler token's text: most thoughts of the random model hold it


def early_exit_config(**kw):
    return GRPOConfig(rollout_mode="early_exit", early_exit_points=3, num_generations=4, early_exit_text="ANSWER:",
                      early_exit_answer_length=4, max_completion_length=10, max_prompt_length=8, **kw)


def multi_answer_config(**kw):
    return GRPOConfig(rollout_mode="multi_answer", num_generations=3, answers_per_thought=2, max_thought_length=8,
                      max_completion_length=4, max_prompt_length=8, per_device_train_batch_size=9, **kw)


def options(c):
    return SamplingOptions.from_config(c)


def seeds(start=0):
    counter = itertools.count(start)
    return lambda: next(counter)


def _first_masked(mask: torch.Tensor) -> int:
    return int((~mask).nonzero()[0]) if (~mask).any() else len(mask)


def check_early_exit(engine, tokenizer):
    c = early_exit_config()
    batch = early_exit.serial_groups(engine, tokenizer, PROMPTS, ROWS, c, seeds(), sampling=options(c))
    m, injected = c.early_exit_points, tokenizer.encode(c.early_exit_text, add_special_tokens=False)
    assert len(batch) == len(PROMPTS) * (m + 1)
    assert batch.kind == (["cut"] * m + ["full"]) * len(PROMPTS)
    for g, prompt in enumerate(PROMPTS):
        members = list(range(g * (m + 1), (g + 1) * (m + 1)))
        full = members[-1]
        assert batch.prompt_ids[full] == prompt and bool(batch.loss_mask[full].all())
        body = len(batch.completion_ids[full]) - (batch.finish_reason[full] == "stop")
        previous = 0
        for i in members[:-1]:
            ids, mask, logp = batch.completion_ids[i], batch.loss_mask[i], batch.sampling_logp[i]
            k = _first_masked(mask)  # the cut: the policy's prefix, then the injected text
            assert previous <= k and (k < body or k == 0), "cuts fall in the completion, shortest first"
            previous = k
            assert ids[:k] == batch.completion_ids[full][:k], "a cut continues the group's full completion"
            assert ids[k : k + len(injected)] == injected
            assert not mask[k : k + len(injected)].any() and bool(mask[k + len(injected) :].all())
            assert torch.isnan(logp[k : k + len(injected)]).all() and not torch.isnan(logp[mask]).any()
            answer = ids[k + len(injected) :]
            assert 1 <= len(answer) <= c.early_exit_answer_length
            assert batch.completion_texts[i] == tokenizer.decode(answer, skip_special_tokens=True), "graded on its answer"
            assert torch.equal(logp[:k], batch.sampling_logp[full][:k])
    again = early_exit.serial_groups(engine, tokenizer, PROMPTS, ROWS, c, seeds(), sampling=options(c))
    assert again.completion_ids == batch.completion_ids, "seeded: the same serial groups"
    return batch


def check_multi_answer(engine, tokenizer):
    c = multi_answer_config(thought_end=THOUGHT_END)
    K, M = c.num_generations, c.answers_per_thought
    batch = multi_answer.thoughts_and_answers(engine, tokenizer, PROMPTS, ROWS, c, THOUGHT_END, seeds(), sampling=options(c))
    assert len(batch) == len(PROMPTS) * K * (1 + M)
    assert batch.kind == (["thought"] * K + ["answer"] * K * M) * len(PROMPTS)
    ended = 0
    for g, prompt in enumerate(PROMPTS):
        base = g * K * (1 + M)
        for j in range(K):
            thought = batch.completion_ids[base + j]
            assert len(thought) <= c.max_thought_length and bool(batch.loss_mask[base + j].all())
            text = tokenizer.decode(thought, skip_special_tokens=True)
            if THOUGHT_END in text:  # it ends the thought: the token completing it is the last one
                ended += 1
                assert THOUGHT_END not in tokenizer.decode(thought[:-1], skip_special_tokens=True)
            assert tokenizer.eos_token_id not in thought, "the answers continue the thought"
            for a in range(M):
                i = base + K + j * M + a
                ids, mask = batch.completion_ids[i], batch.loss_mask[i]
                assert batch.prompt_ids[i] == prompt and ids[: len(thought)] == thought, "the shared thought prefix"
                assert not mask[: len(thought)].any() and bool(mask[len(thought) :].all())
                assert 1 <= len(ids) - len(thought) <= c.max_completion_length
                assert torch.isnan(batch.sampling_logp[i][: len(thought)]).all()
                assert batch.completion_texts[i] == tokenizer.decode(ids, skip_special_tokens=True)
    assert ended >= 1, "some thought should have met thought_end (the test would check nothing)"
    return batch


@pytest.fixture(scope="module")
def hf(tiny_path):
    from tests.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(tiny_path)
    return HFEngine(model, tokenizer), tokenizer


def test_early_exit_serial_groups_hf(hf):
    check_early_exit(*hf)


def test_multi_answer_thoughts_and_answers_hf(hf):
    check_multi_answer(*hf)


def test_end_of_thought_cuts_after_the_token_completing_it(hf):
    _, tokenizer = hf
    ids = tokenizer.encode("12 + 3 = 15 </think> so 15", add_special_tokens=False)
    k = multi_answer.end_of_thought(tokenizer, ids, "</think>")
    assert tokenizer.decode(ids[:k]) == "12 + 3 = 15 </think>"
    assert multi_answer.end_of_thought(tokenizer, ids, "never") == len(ids)


def test_cut_positions_spread_one_per_span():
    import random

    rng = random.Random(0)
    for length, m in [(100, 7), (5, 7), (1, 3), (0, 2)]:
        cuts = early_exit.cut_positions(length, m, rng)
        assert len(cuts) == m and cuts == sorted(cuts) and all(0 <= k < max(length, 1) for k in cuts)
        if length >= m:
            assert all(i * length / m <= k < (i + 1) * length / m for i, k in enumerate(cuts)), cuts


def test_cut_positions_are_distinct_when_the_completion_has_room():
    import random

    rng = random.Random(1)
    for length, m in [(10, 7), (8, 3), (7, 7), (100, 7), (13, 5)]:
        for _ in range(200):  # (the old draw, floor of a point in each span, gave the same cut twice at a span's edge)
            cuts = early_exit.cut_positions(length, m, rng)
            assert len(set(cuts)) == m and cuts == sorted(cuts) and all(0 <= k < length for k in cuts), (length, m, cuts)
            assert all(i * length / m <= k < (i + 1) * length / m for i, k in enumerate(cuts)), cuts


def test_completions_shorter_than_the_cuts_are_warned_about(hf, monkeypatch, caplog):
    engine, tokenizer = hf
    c = GRPOConfig(rollout_mode="early_exit", early_exit_points=7, num_generations=8, early_exit_text="ANSWER:",
                   early_exit_answer_length=2, max_completion_length=10, max_prompt_length=8, per_device_train_batch_size=16)
    c.max_completion_length = 4  # as if every completion ended (EOS) after at most 4 tokens: fewer than the 7 cuts
    monkeypatch.setitem(early_exit._warned, "short", False)
    with caplog.at_level("WARNING", logger="grpo_fast.generation.modes.early_exit"):
        batch = early_exit.serial_groups(engine, tokenizer, PROMPTS, ROWS, c, seeds(), sampling=options(c))
        early_exit.serial_groups(engine, tokenizer, PROMPTS, ROWS, c, seeds(), sampling=options(c))
    warned = [r.getMessage() for r in caplog.records if "early_exit_points=7" in r.getMessage()]
    assert len(warned) == 1 and "of 2 full completions" in warned[0] and "cuts coincide" in warned[0], warned
    cuts = [_first_masked(mask) for mask, kind in zip(batch.loss_mask, batch.kind, strict=True) if kind == "cut"]
    assert len(set(cuts[:7])) < 7, "the test should have made coinciding cuts"


def test_early_exit_config_needs_m_plus_one_generations():
    with pytest.raises(ValueError, match=r"num_generations=4 .*early_exit_points \+ 1 = 8"):
        GRPOConfig(rollout_mode="early_exit", num_generations=4)
    with pytest.raises(ValueError, match="dynamic_sampling=True .*rollout_mode='multi_answer'"):
        GRPOConfig(rollout_mode="multi_answer", dynamic_sampling=True, per_device_train_batch_size=40)
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=64 .*num_generations x \(1 \+ answers_per_thought\) = 40"):
        GRPOConfig(rollout_mode="multi_answer")  # a batch counts thoughts and answers: 8 x (1 + 4) a prompt
    assert math.isclose(early_exit_config().vllm_max_model_length, 8 + 10 + len("ANSWER:") + 4)

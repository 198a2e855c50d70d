"""Generative judges (rewards/judge.py) on the tiny model as the judge: judge_rank sees each group once,
whole and in order; answers decoded under the format parse; free-text garbage gives None after the retries
and training goes on; a vLLM judge beside a vLLM policy is never touched by the weight sync."""

import json
import math

import pytest

from grpo_fast.config import GRPOConfig
from grpo_fast.generation.engines import vllm_available
from grpo_fast.rewards import get_reward_funcs
from grpo_fast.rewards.judge import DEFAULT_RANK_PROMPT, JudgeOptions, JudgeRank, JudgeScore, judge_for
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config, rows, target_fraction
from tests.trainer.conftest import one_thread  # noqa: F401 (autouse: one thread, as the trainer tests)


def _recording(seen: list):
    """target_fraction that records each call's (prompts, completions): what the judge should have seen."""
    def recorded(prompts, completions, completion_ids, **columns):
        seen.append((list(prompts), list(completions)))
        return target_fraction(prompts, completions, completion_ids)

    recorded.__name__ = "target_fraction"
    return recorded


def _rows_of(path):
    with open(path / "run" / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "reward" in r]


def test_judge_rank_sees_each_group_once_whole_and_in_order(tmp_path, tiny, tiny_model_dir):
    judge = JudgeRank(JudgeOptions(model=tiny_model_dir, engine="hf", max_new_tokens=40))
    judge.judge.requests.clear()
    seen = []
    c = config(tmp_path, max_steps=2, eval_before_train=False, save_final=False, report_to="none")
    GRPOTrainer(c, [_recording(seen), judge], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    G = c.num_generations
    groups = [(p[k], comps[k:k + G]) for p, comps in seen for k in range(0, len(comps), G)]
    assert len(groups) == 2 * c.per_device_train_batch_size // G
    assert len(judge.judge.requests) == len(groups), "each group exactly once"
    for text, (prompt, members) in zip(judge.judge.requests, groups, strict=True):  # whole, in order
        listed = "\n\n".join(f"Response {k + 1}:\n{m}" for k, m in enumerate(members))
        assert text == (DEFAULT_RANK_PROMPT.replace("{min}", "0").replace("{max}", "10").replace("{prompt}", prompt)
                        .replace("{completions}", listed).replace("{n}", str(G)))
    for r in _rows_of(tmp_path):  # structured output on: every answer parsed, the scores in [0, 1]
        assert r["judge/unparsable"] == 0 and r["judge/requests"] == len(groups) // 2 and r["judge/tokens"] > 0
        assert 0 <= r["rewards/judge_rank/mean"] <= 1 and r["judge/seconds"] > 0
        assert not any(k.startswith("time/judge") for k in r), "judge time is in time/reward, not a time/ key"


def test_free_text_garbage_gives_none_after_the_retries_and_the_step_goes_on(tmp_path, tiny, tiny_model_dir):
    options = JudgeOptions(model=tiny_model_dir, engine="hf", max_new_tokens=24, max_retries=1, structured_output=False)
    judge = JudgeRank(options)
    calls = []
    generate = judge.judge.engine.generate

    def counted(prompt_ids, **kwargs):  # the real engine, its calls counted
        calls.append((len(prompt_ids), kwargs["regex"]))
        return generate(prompt_ids, **kwargs)

    judge.judge.engine.generate = counted
    try:
        c = config(tmp_path, max_steps=1, eval_before_train=False, save_final=False, report_to="none")
        last = GRPOTrainer(c, [target_fraction, judge], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    finally:
        judge.judge.engine.generate = generate
    groups = c.per_device_train_batch_size // c.num_generations
    assert calls == [(1, None), (1, None)] * groups, "one try and one retry per group, no format constraint"
    mean = last["rewards/judge_rank/mean"]  # (no value at all: NaN, logged as null)
    assert last["judge/unparsable"] == groups and (mean is None or math.isnan(mean))
    assert math.isfinite(last["loss"]) and last["grad_norm"] > 0, "the step trained on the other reward"


def test_answers_parse_into_the_range_and_bad_ones_are_none(tiny_model_dir):
    score = JudgeScore(JudgeOptions(model=tiny_model_dir, engine="hf", score_range=(1, 5)))
    assert score.pattern == r"(5(\.0)?|(4|3|2|1)(\.[0-9])?)"
    assert JudgeScore(JudgeOptions(model=tiny_model_dir, engine="hf", score_range=(0, 1000))).pattern == r"[0-9]{1,4}(\.[0-9])?"
    assert [score._parse(t) for t in ("1", "3", "5", "4.5", " 2 ", "6", "0", "x", None)] == \
        [0.0, 0.5, 1.0, 0.875, 0.25, None, None, None, None]
    values = score(["What is 2 + 2?", "Name a colour."], ["4", "blue"])
    assert all(v is not None and 0 <= v <= 1 for v in values), values
    rank = JudgeRank(JudgeOptions(model=tiny_model_dir, engine="hf"))
    assert rank._parse("1, 10, 5", 3) == [0.1, 1.0, 0.5] and rank._parse("1, 10", 3) is None
    assert rank._parse("1, 11, 5", 3) is None  # a score outside the range: the whole answer is asked again


def test_judge_options_are_refused_by_name_before_work(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"GRPOConfig.judge_model=None is invalid: expected a judge model"):
        GRPOConfig(reward_funcs=["math", "judge_rank"], output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"GRPOConfig.judge_model=None is invalid"):
        GRPOConfig(partial_credit_judge="judge_score", output_dir=str(tmp_path))
    for bad in ([5, 1], [0], [0, math.inf], ["0", 10]):
        with pytest.raises(ValueError, match=r"GRPOConfig.judge_score_range=.* is invalid: expected \[low, high\]"):
            GRPOConfig(judge_score_range=bad, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"GRPOConfig.judge_max_retries=-1 is invalid"):
        GRPOConfig(judge_max_retries=-1, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"judge_engine must be one of"):
        JudgeScore(JudgeOptions(model=tiny_model_dir, engine="tgi"))
    with pytest.raises(ValueError, match=r"judge_prompt for judge_rank: expected a template with \{prompt\} and "
                                         r"\{completions\}, missing \['\{completions\}'\]"):
        JudgeRank(JudgeOptions(model=tiny_model_dir, engine="hf", prompt="Rate {prompt}: {completion}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"judge_model=.*empty.*: model folder .* is missing config.json"):
        JudgeScore(JudgeOptions(model=str(tmp_path / "empty"), engine="hf"))
    with pytest.raises(ValueError, match=r"reward 'judge_score' needs a judge model: set judge_model"):
        get_reward_funcs(["judge_score"])


def test_the_cli_names_build_judges_and_partial_credit_can_be_judge_score(tmp_path, tiny_model_dir):
    from grpo_fast.data import inputs

    c = GRPOConfig(reward_funcs=["math", "judge_score", "judge_rank"], judge_model=tiny_model_dir, judge_engine="hf",
                   rollout_mode="parallel", partial_credit_judge="judge_score", output_dir=str(tmp_path))
    _, score, rank = get_reward_funcs(list(c.reward_funcs), **inputs.reward_options(c, c.num_generations))
    assert isinstance(score, JudgeScore) and isinstance(rank, JudgeRank) and rank.takes_groups
    assert score.judge is rank.judge, "one judge engine for both"
    assert isinstance(inputs.partial_credit_judge(c.partial_credit_judge, [{"prompt": "p", "answer": "1"}],
                                                 inputs.reward_options(c, c.num_generations)), JudgeScore)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
def test_a_vllm_judge_beside_the_vllm_policy_is_untouched_by_its_weight_sync(tmp_path, tiny, tiny_model_dir):
    judge = judge_for(JudgeOptions(model=tiny_model_dir, engine="vllm", max_new_tokens=8))
    try:
        probe = list(range(3, 40))
        before = judge.engine.prompt_logprobs(probe)
        score = JudgeScore(JudgeOptions(model=tiny_model_dir, engine="vllm", max_new_tokens=8))
        assert score.judge is judge
        c = config(tmp_path, engine="vllm", max_steps=2, eval_before_train=False, save_final=False, report_to="none")
        trainer = GRPOTrainer(c, [target_fraction, score], rows(), model=tiny[0], tokenizer=tiny[1])
        trainer.train()
        assert trainer.engine is not judge.engine
        assert judge.engine.prompt_logprobs(probe) == before, "the policy's weight sync reached the judge"
        assert trainer.engine.prompt_logprobs(probe) != before, "the policy trained (its engine moved)"
        for r in _rows_of(tmp_path):
            assert r["judge/unparsable"] == 0 and 0 <= r["rewards/judge_score/mean"] <= 1
            assert r["judge/requests"] == c.per_device_train_batch_size
    finally:
        judge.close()

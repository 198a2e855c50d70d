"""Bad input to `generate` fails before any work with an error naming the argument (HFEngine here;
the vLLM engine shares the validation, see test_vllm_engine.py)."""

import pytest

from grpo_fast.generation.engines import make_engine


@pytest.fixture(scope="module")
def engine(tiny_policy):
    return make_engine("hf", model=tiny_policy[0], tokenizer=tiny_policy[1], max_model_len=16)


@pytest.mark.parametrize(
    "prompts,kwargs,error,match",
    [
        ([[1] * 16], {}, ValueError, r"prompt_ids\[0\] has 16 tokens.*max_model_len=16"),
        ([[1, 2], [1] * 20], {}, ValueError, r"prompt_ids\[1\] has 20 tokens"),
        ([[1, 2], []], {}, ValueError, r"prompt_ids\[1\] is empty"),
        ([[1, 2, 320]], {}, ValueError, r"prompt_ids\[0\] holds token id 320, outside .*\[0, 320\)"),
        ([[1, -1]], {}, ValueError, r"prompt_ids\[0\] holds token id -1"),
        ([[1, 2.5]], {}, TypeError, r"prompt_ids\[0\] must hold ints"),
        ("hello", {}, TypeError, r"prompt_ids must be a list"),
        ([[1, 2]], {"n": 0}, ValueError, r"n \(completions per prompt\) must be an int >= 1, got 0"),
        ([[1, 2]], {"max_new_tokens": 0}, ValueError, r"max_new_tokens must be an int >= 1"),
        ([[1, 2]], {"temperature": -1.0}, ValueError, r"temperature must be"),
        ([[1, 2]], {"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ([[1, 2]], {"top_k": -5}, ValueError, r"top_k must be"),
        ([[1, 2]], {"stop_token_ids": [999]}, ValueError, r"stop_token_ids must lie in \[0, 320\)"),
    ],
)
def test_bad_input(engine, prompts, kwargs, error, match):
    args = {"n": 1, "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        engine.generate(prompts, **args)


def test_empty_prompt_list_returns_empty(engine):
    assert engine.generate([], n=2, max_new_tokens=3) == []


def test_make_engine_checks_its_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        make_engine("sglang")
    with pytest.raises(ValueError, match="kind='hf' needs model= and tokenizer="):
        make_engine("hf")
    with pytest.raises(ValueError, match="kind='vllm' needs model_path"):
        make_engine("vllm")


def test_make_engine_auto_without_path_is_hf_and_drops_vllm_options(tiny_policy):
    engine = make_engine("auto", model=tiny_policy[0], tokenizer=tiny_policy[1], dtype="float32", max_model_len=32)
    assert type(engine).__name__ == "HFEngine" and engine.max_model_len == 32

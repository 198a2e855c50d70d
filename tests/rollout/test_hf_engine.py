"""HFEngine against an independent recomputation of the processed log-probs from full logits."""

import pytest
import torch

from grpo_fast.generation.engines import Completion, make_engine
from grpo_fast.generation.engines.hf_engine import HFEngine
from tests.helpers import assert_close, scaled

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def engine(tiny_policy):
    model, tokenizer = tiny_policy
    return HFEngine(model, tokenizer)


def processed_logprobs(model, prompt, completion, temperature, top_k=-1):
    """Reference in float64: log-softmax(top-k(logits / T)) at each completion position."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()  # (T_new, V)
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (0.8, 20)])
def test_groups_shapes_and_processed_logprobs(engine, tiny_policy, temperature, top_k):
    groups = engine.generate(PROMPTS, n=3, max_new_tokens=7, temperature=temperature, top_k=top_k, seed=0)
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            assert isinstance(c, Completion) and 1 <= len(c.token_ids) <= 7
            assert len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == ("stop" if c.token_ids[-1] in engine.eos_ids else "length")
            expected = processed_logprobs(tiny_policy[0], prompt, c.token_ids, temperature, top_k)
            assert_close(c.logprobs, expected, atol=scaled(1e-4, expected), name=f"logprobs T={temperature} top_k={top_k}")
    # samples of one prompt differ (n rows are sampled independently)
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1


def test_greedy_is_argmax_with_raw_logprobs(engine, tiny_policy):
    model = tiny_policy[0]
    ((c,),) = engine.generate([PROMPTS[0]], n=1, max_new_tokens=5, temperature=0)
    ids = torch.tensor([PROMPTS[0] + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    assert c.token_ids == logits.argmax(-1).tolist()
    expected = processed_logprobs(model, PROMPTS[0], c.token_ids, 0.0)
    assert_close(c.logprobs, expected, atol=scaled(1e-4, expected), name="greedy logprobs")


def test_stop_tokens_and_max_new_tokens(engine):
    ((free,),) = engine.generate([PROMPTS[1]], n=1, max_new_tokens=6, temperature=0)
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    stop = free.token_ids[2]
    ((cut,),) = engine.generate([PROMPTS[1]], n=1, max_new_tokens=6, temperature=0, stop_token_ids=[stop])
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[: first + 1], rel=1e-5, abs=1e-5)


def test_seed_reproducible(engine):
    a = engine.generate(PROMPTS, n=2, max_new_tokens=5, seed=7)
    b = engine.generate(PROMPTS, n=2, max_new_tokens=5, seed=7)
    c = engine.generate(PROMPTS, n=2, max_new_tokens=5, seed=8)
    ids = lambda groups: [[x.token_ids for x in g] for g in groups]
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_per_prompt_seeds_do_not_depend_on_the_split(engine):
    """A batch split over ranks samples what the whole batch samples: each prompt's group depends on its
    own seed only."""
    ids = lambda groups: [[x.token_ids for x in g] for g in groups]
    whole = engine.generate(PROMPTS, n=2, max_new_tokens=5, seed=[11, 12, 13])
    parts = [engine.generate([p], n=2, max_new_tokens=5, seed=[s]) for p, s in zip(PROMPTS, [11, 12, 13], strict=True)]
    assert ids(whole) == [g for part in parts for g in ids(part)]
    swapped = engine.generate(PROMPTS[::-1], n=2, max_new_tokens=5, seed=[13, 12, 11])
    assert ids(swapped) == ids(whole)[::-1], "the order within a call does not matter either"
    with pytest.raises(ValueError, match=r"seed: a list of seeds needs one int per prompt"):
        engine.generate(PROMPTS, n=1, max_new_tokens=2, seed=[1])


def test_shares_weights_and_keeps_training_mode(tiny_model_dir):
    from tests.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(tiny_model_dir)
    engine = make_engine("hf", model=model, tokenizer=tokenizer)
    before = engine.generate([PROMPTS[0]], n=1, max_new_tokens=4, temperature=0)[0][0]
    model.train()
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))  # tied: embeddings move too
    engine.update_weights(model)  # no-op by design; the engine holds the module itself
    after = engine.generate([PROMPTS[0]], n=1, max_new_tokens=4, temperature=0)[0][0]
    assert model.training, "generate must hand the caller's training mode back"
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)


def test_max_model_len_caps_generation(tiny_policy):
    engine = HFEngine(*tiny_policy, max_model_len=8)
    (a,), (b,) = engine.generate([[1, 2, 3, 4, 5, 6], [1, 2]], n=1, max_new_tokens=10, temperature=0)
    assert len(a.token_ids) == 2 and a.finish_reason == "length"
    assert len(b.token_ids) == 6


def test_decoding_under_a_regex_and_on_group_after_the_batch(engine):
    """The HF engine constrains decoding with xgrammar's processor (what vLLM's structured outputs use), sampled
    and greedy; it cannot stream, so on_group comes for every group, in order, after the batch."""
    import re

    pattern = r"[0-9]{1,2}(, [0-9]{1,2}){2}"
    handed = []
    for temperature in (1.0, 0.0):
        groups = engine.generate(PROMPTS, n=2, max_new_tokens=20, temperature=temperature, seed=3, regex=pattern,
                                 on_group=lambda i, g: handed.append(i))
        texts = [c.text for g in groups for c in g]
        assert all(re.fullmatch(pattern, t) for t in texts), texts
        assert all(c.finish_reason == "stop" and len(c.logprobs) == len(c.token_ids) for g in groups for c in g)
    assert handed == [0, 1, 2, 0, 1, 2]
    free = engine.generate(PROMPTS, n=2, max_new_tokens=20, seed=3)
    assert not any(re.fullmatch(pattern, c.text) for g in free for c in g)

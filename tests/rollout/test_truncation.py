"""Truncated sampling, engine side (generation/truncation.py): the kept sets the HF engine returns are its warpers'
kept tokens, vLLM's rule on the k largest logits equals it on whole logits, vLLM's `sampling_mask` output (a fixture
of its format: Model Runner V2 cannot start here) becomes the same record, and kept sets ride partial rollouts'
members through a checkpoint. vLLM's own functions against the rule: tests/rollout/test_vllm_engine.py."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo_fast.generation.engines.base import SamplingOptions
from grpo_fast.generation.engines.hf_engine import HFEngine, _warpers
from grpo_fast.generation.truncation import KeptTokens, Truncation, kept_from_candidates, kept_mask, pack
from tests.helpers import assert_close, scaled

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def random_logits(seed: int, ties: bool = False, rows: int = 48, vocab: int = 300) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return (logits * 2).round() / 2 if ties else logits  # (half-integer logits: many ties)


def as_mask(ids: torch.Tensor, offsets: torch.Tensor, shape) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[torch.repeat_interleave(torch.arange(shape[0]), offsets.diff()), ids] = True
    return mask


RULES = [Truncation(top_p=0.8, top_k=40), Truncation(top_k=20), Truncation(min_p=0.1, top_k=40, top_p=0.9),
         Truncation(min_p=0.05, top_k=40), Truncation(top_k=1)]


@pytest.mark.parametrize("ties", [False, True])
def test_the_rule_on_the_k_largest_equals_it_on_whole_logits(ties):
    """What the trainer rebuilds from a vocab pass (the k largest and the lse) is vLLM's rule on the whole row, for
    min_p, top_k and top_p alone and together, with ties inside the kept sets."""
    for seed in range(4):
        for rule in RULES:
            logits = random_logits(seed, ties)
            values, ids = logits.topk(rule.top_k + 4, dim=-1)
            if ties:  # the k-th value must not tie past the candidates (the sets are bounded by k): skip those rows
                keep = values[:, rule.top_k - 1] > values[:, rule.top_k]
                logits, values, ids = logits[keep], values[keep], ids[keep]
            got, offsets, added = kept_from_candidates(values, ids, logits.logsumexp(-1), rule)
            got, want = as_mask(got, offsets, logits.shape), kept_mask(logits, rule)
            assert added == 0 and torch.equal(got.sum(-1), want.sum(-1)), (seed, rule)
            # tokens tied at the top_p edge: vLLM's unstable sort of the whole row picks which stay; all else equal
            edge = logits.masked_fill(~want, float("inf")).amin(-1, keepdim=True)
            differ = got ^ want
            assert not (differ & (logits != edge)).any(), (seed, rule)
            assert ties or not differ.any(), (seed, rule)


def test_a_sampled_token_outside_the_rebuilt_set_is_kept_and_counted():
    logits = random_logits(7)
    rule = Truncation(top_p=0.5, top_k=30)
    values, ids = logits.topk(30, dim=-1)
    sampled = logits.argmax(-1)
    sampled[:5] = logits[:5].argmin(-1)  # 5 tokens the rule cuts (rounding put them at the edge, say)
    got, offsets, added = kept_from_candidates(values, ids, logits.logsumexp(-1), rule, sampled=sampled)
    assert added == 5
    mask = as_mask(got, offsets, logits.shape)
    assert mask[torch.arange(len(sampled)), sampled].all()
    assert torch.equal(mask ^ kept_mask(logits, rule), torch.zeros_like(mask).index_put_(
        (torch.arange(5), sampled[:5]), torch.tensor(True)))
    with pytest.raises(ValueError, match=r"needs top_k in \[1, 30\].*got top_k=-1"):
        kept_from_candidates(values, ids, logits.logsumexp(-1), Truncation(top_p=0.5))


@pytest.fixture(scope="module")
def engine(tiny_policy):
    model, tokenizer = tiny_policy
    return HFEngine(model, tokenizer)


@pytest.mark.parametrize("sampling", [SamplingOptions(temperature=0.8, top_p=0.8, top_k=20),
                                      SamplingOptions(min_p=0.05, top_k=30), SamplingOptions(top_p=0.7)])
def test_hf_engine_returns_its_warpers_kept_tokens(engine, tiny_policy, sampling):
    """Each token's set is what the warpers (temperature, min_p, top_k, top_p: vLLM's order) leave finite on the
    model's logits at its step, the sampled token is in it, and the processed log-prob is the log-softmax over it."""
    model = tiny_policy[0]
    groups = engine.generate(PROMPTS, n=2, max_new_tokens=6, sampling=sampling, seed=[3, 4])
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1: -1].float()
            scores = logits
            for warper in _warpers(sampling):
                scores = warper(ids, scores)
            kept = scores.isfinite()
            assert c.kept is not None and len(c.kept) == len(c.token_ids)
            assert torch.equal(as_mask(c.kept.ids.long(), c.kept.offsets, kept.shape), kept)
            assert torch.equal(kept, kept_mask(logits / sampling.temperature, Truncation.of(sampling)))  # vLLM's rule
            expected = (logits / sampling.temperature).masked_fill(~kept, -float("inf")).log_softmax(-1)
            expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert_close(c.logprobs, expected, atol=scaled(1e-5, expected), name="log-probs over the kept set")


def test_no_kept_sets_without_truncation(engine):
    plain = engine.generate(PROMPTS[:1], n=1, max_new_tokens=3, seed=1)[0][0]
    greedy = engine.generate(PROMPTS[:1], n=1, max_new_tokens=3, temperature=0, top_p=0.5)[0][0]
    assert plain.kept is None and greedy.kept is None


def test_a_run_bounds_top_k_and_min_p_is_checked():
    assert SamplingOptions(top_p=0.9).bounded().top_k == 512 and SamplingOptions(top_p=0.9).top_k == -1
    assert SamplingOptions(min_p=None).min_p == 0.0 and not SamplingOptions(temperature=0, top_k=5).truncates
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingOptions(min_p=-0.1)


# ---- vLLM: written against its API, checked on a fixture of its output ----


def vllm_output(token_ids, sets):
    """Shaped like vllm.outputs.CompletionOutput (0.32) of a finished request with return_sampling_mask: the
    sampled ids, a per-step {token: Logprob} dict and `sampling_mask` (vllm.outputs.SamplingMask: one list of kept
    ids per generated token)."""
    return SimpleNamespace(index=0, text="", token_ids=list(token_ids), cumulative_logprob=None,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=None)} for t in token_ids],
                           sampling_mask=SimpleNamespace(token_ids=sets), finish_reason="stop", stop_reason=None)


def test_vllm_sampling_masks_become_the_kept_sets():
    from grpo_fast.generation.engines import vllm_engine
    from tests.tiny_model import build_tiny_tokenizer

    sets = [[5, 9, 11], [2, 7]]
    completion = vllm_engine.VLLMEngine._completion(vllm_output([9, 2], sets), build_tiny_tokenizer(), kept=True)
    assert completion.kept == KeptTokens.from_lists(sets) and completion.kept.lists() == sets
    assert vllm_engine.VLLMEngine._completion(vllm_output([9, 2], sets), build_tiny_tokenizer()).kept is None
    with pytest.raises(RuntimeError, match="sampling_mask has 1 sets for 2 generated tokens"):
        vllm_engine.VLLMEngine._completion(vllm_output([9, 2], sets[:1]), build_tiny_tokenizer(), kept=True)
    # vLLM needs top_k > 0 and temperature > 0 in every request: greedy as top_k = 1, untruncated refused
    fields = dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    assert vllm_engine._with_masks(fields) == dict(temperature=1.0, top_p=1.0, top_k=1, min_p=0.0)
    assert vllm_engine._with_masks({**fields, "temperature": 0.7, "top_k": 512}) == {**fields, "temperature": 0.7,
                                                                                     "top_k": 512}
    with pytest.raises(ValueError, match="vLLM needs top_k > 0 in every sampled request; got top_k=-1"):
        vllm_engine._with_masks({**fields, "temperature": 1.0})


def test_vllm_api_the_path_is_written_against():
    """The installed vLLM's names the return_sampling_mask path uses (read from its source, no import: 9 s)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    root = Path(spec.submodule_search_locations[0])
    assert "return_sampling_mask: bool = False" in (root / "entrypoints" / "llm.py").read_text()
    outputs = (root / "outputs.py").read_text()
    assert "class SamplingMask:" in outputs and "token_ids: list[list[int]]" in outputs
    assert "sampling_mask: SamplingMask | None = None" in outputs
    assert "sampling distribution replay requires top_k > 0" in (root / "v1" / "engine" / "input_processor.py").read_text()


# ---- kept sets through packing and partial rollouts' checkpoints ----


def test_kept_sets_pack_into_a_micro_batch_and_round_trip_a_checkpoint(tmp_path):
    from grpo_fast.generation.rounds import Group, Member
    from grpo_fast.train.state import TrainState

    a, b = KeptTokens.from_lists([[3, 4], [5]]), KeptTokens.from_lists([[7], [8, 9], [1, 2, 6]])
    packed = pack([a, b, a], rows=[1, 2], width=3)  # rows of a micro-batch, padded to its longest completion
    assert packed.lengths.tolist() == [1, 2, 3, 2, 1, 0] and packed.ids.tolist() == [7, 8, 9, 1, 2, 6, 3, 4, 5]
    assert KeptTokens.cat([a, b]).lists() == a.lists() + b.lists()
    from grpo_fast.generation.batch import Rollouts

    part = Rollouts([[1]], [[4, 5]], [torch.zeros(2)], ["stop"], [""], [{}], kept=[a])
    assert Rollouts.concat([part, part]).kept == [a, a]
    assert Rollouts.concat([part, dataclasses.replace(part, kept=None)]).kept is None  # (the trainer rebuilds them)

    # a member continued over two rounds keeps its sets; the checkpoint holds them, and the format without them
    first = Member().extended(SimpleNamespace(token_ids=[4, 5], logprobs=[-0.1, -0.2], finish_reason=None, kept=a), 1)
    member = first.extended(SimpleNamespace(token_ids=[9, 1, 6], logprobs=[-1.0, -2.0, -3.0], finish_reason="stop",
                                            kept=b), 2)
    assert member.kept == KeptTokens.cat([a, b]) and member.ver == [1, 1, 2, 2, 2]
    state = TrainState(policy_version=2, in_flight=[Group(3, 7, [member, Member([4], [-0.5], [1])])])
    torch.save({"state": state.to_dict()}, tmp_path / "trainer_state.pt")
    saved = torch.load(tmp_path / "trainer_state.pt", weights_only=False)["state"]
    assert saved["in_flight"][0]["members"][1] == {"ids": [4], "logp": [-0.5], "ver": [1], "finish": None}
    assert TrainState.from_dict(saved) == state
    assert TrainState.from_dict(saved).in_flight[0].members[0].kept.ids.dtype == torch.int32

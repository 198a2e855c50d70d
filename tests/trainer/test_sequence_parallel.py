"""Sequence parallelism's split of a packed row (grpo_fast/train/sequence_parallel.py), in one process: each of the
issue's boundary cases cut for N = 2 and 3 ranks, each shard's hidden states taken from one decoder forward of the
whole row (what Ulysses computes, tests/distributed/test_sequence_parallel.py checks that on 2 ranks), and the shards'
log-probs summed as the group sums them; and the refusals, each one line before any work."""

import pytest
import torch

from grpo_fast.ops import masked_linear_logprobs
from grpo_fast.train import sequence_parallel as sp
from grpo_fast.train import ulysses
from grpo_fast.train.forward import completion_hidden
from grpo_fast.train.packing import pack_sequences
from tests.distributed.sequence_parallel_ranks import ROWS, row, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def _cut(case: str, n: int, vocab: int):
    prompts, completions = row(case, vocab)
    mb = pack_sequences(prompts, completions, list(range(len(prompts))), attention="packed")
    return prompts, completions, mb, [sp.shard(mb, sp.Group(r, n, None), None) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", list(ROWS))
def test_each_completion_token_has_one_owner_whose_target_is_the_next_token_of_its_sequence(case, n, model):
    """The shards hold the padded row contiguously; every completion token is owned by exactly one rank, the one
    holding the hidden state that predicts it, and its target is the token after that position in ITS sequence
    (built on the whole row before the cut: at a shard edge the token lives on the next rank, verl#6068)."""
    prompts, completions, mb, shards = _cut(case, n, model.config.vocab_size)
    size = shards[0].shard_inputs["input_ids"].shape[1]
    assert size * n >= mb.num_tokens > size * (n - 1)
    ids = torch.cat([s.shard_inputs["input_ids"] for s in shards], dim=1)
    assert ids[:, : mb.num_tokens].equal(mb.input_ids) and not ids[:, mb.num_tokens:].any(), "padded at the end only"
    assert sum(s.num_tokens for s in shards) == mb.num_tokens
    owners = torch.stack([s.owned for s in shards]).sum(0)
    assert owners.equal(mb.completion_mask.long()), "every completion token once, nothing else"
    starts = mb.cu_seq_lens.tolist()
    for r, s in enumerate(shards):
        assert s.hidden_index.shape == (1, int(s.owned.sum())), "this rank's positions alone, not the micro-batch's"
        for k, (j, t) in enumerate(s.owned.nonzero().tolist()):
            position = r * size + int(s.hidden_index[0, k])  # the row position whose hidden state predicts it
            sequence = prompts[j] + completions[j]
            assert int(mb.target_ids[j, t]) == sequence[position - starts[j] + 1]
            if position == (r + 1) * size - 1 and t + 1 < len(completions[j]):  # cut at the shard edge, mid-sequence
                assert int(ids[0, position + 1]) == int(mb.target_ids[j, t]), "its target is the next rank's token"


def test_the_cases_cut_where_they_say():
    vocab = 320
    _, _, _, two = _cut("edge_between_sequences", 2, vocab)
    assert two[0].owned[0].any() and not two[0].owned[1].any() and not two[1].owned[0].any(), \
        "the first sequence ends at the edge: rank 0 owns all of it (its last token a target only), rank 1 the second"
    _, _, mb, two = _cut("edge_inside_a_sequence", 2, vocab)
    assert two[0].owned[0].any() and two[1].owned[0].any(), "the first sequence spans the edge"
    k = int((two[0].hidden_index[0] == 8).nonzero()[0, 0])  # shard 0's last position predicts ...
    target = int(two[0].own(mb.target_ids)[0, k])
    assert target == int(two[1].shard_inputs["input_ids"][0, 0]), "... rank 1's first token"
    rolled = torch.roll(two[0].shard_inputs["input_ids"][0], -1)  # labels rolled after slicing (verl#6068)
    assert int(rolled[8]) != target, "a shard-local roll would mislabel it"
    _, _, mb, three = _cut("not_divisible", 3, vocab)
    assert mb.num_tokens == 7 and [s.num_tokens for s in three] == [3, 3, 1]
    _, _, _, two = _cut("prompt_only_shard", 2, vocab)
    assert not two[0].owned.any() and two[0].num_tokens == 6, "rank 0 holds 6 prompt tokens and no completion token"
    _, _, mb, two = _cut("longer_than_a_shard", 2, vocab)
    assert int(mb.cu_seq_lens[1]) > two[0].shard_inputs["input_ids"].shape[1]
    for n in (2, 3):
        _, _, _, shards = _cut("spanning_every_shard", n, vocab)
        assert all(s.owned.any() for s in shards), "one sequence, a part of it on every rank"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", list(ROWS))
def test_the_shards_log_probs_summed_equal_the_whole_rows(case, n, model):
    """Each rank's hidden states are its slice of the row's (one decoder forward of the whole row, mask attention),
    its log-probs those of the positions it owns (temperature and logit map on every shard); their sum over the
    ranks is the unsharded log-probs, also with the last rank's tokens all masked out of the loss."""
    _, _, mb, shards = _cut(case, n, model.config.vocab_size)
    whole_mb = pack_sequences(*row(case, model.config.vocab_size), list(range(len(mb.rows))), attention="mask")
    with torch.no_grad():
        full = model.model(input_ids=whole_mb.input_ids, position_ids=whole_mb.position_ids,
                           attention_mask=whole_mb.attention_mask).last_hidden_state[0]
        expected_hidden = completion_hidden(model.model, whole_mb)
    weight = model.lm_head.weight.detach()
    size = shards[0].shard_inputs["input_ids"].shape[1]
    padded = torch.cat([full, full.new_zeros(size * n - full.shape[0], full.shape[1])])
    for mask in (mb.completion_mask, mb.completion_mask & ~shards[-1].owned):
        expected = masked_linear_logprobs(expected_hidden, weight, mb.target_ids, mask, temperature=0.7)
        summed = sum(s.spread(masked_linear_logprobs(padded[r * size: (r + 1) * size][s.hidden_index], weight,
                                                     s.own(mb.target_ids), s.own(mask), temperature=0.7))
                     for r, s in enumerate(shards))
        torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_head_rule_refusal_names_the_heads_and_the_sizes_that_work():
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)  # (a model config's head counts)
    assert ulysses.working_sizes(9, 3) == [1, 3, 9]
    ulysses.check_heads(smollm2, 3)
    with pytest.raises(ValueError) as err:
        ulysses.check_heads(smollm2, 2)
    message = str(err.value)
    assert "\n" not in message and "9 query heads, 3 KV heads" in message and "sizes that work: 1, 3, 9" in message
    assert ulysses.working_sizes(32, 8, 32) == [1, 2, 4, 8, 16, 32]  # 16, 32: KV heads repeated (N % 8 == 0)
    with pytest.raises(ValueError, match="4 query heads, 2 KV heads"):
        ulysses.check_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 3)


def test_refusals_in_one_line_before_work(model):
    from grpo_fast import config_checks
    from grpo_fast.config import GRPOConfig
    from grpo_fast.distributed import check_sequence_parallel

    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 is invalid: expected a divisor of the number of "
                                         r"ranks \(WORLD_SIZE=4"):
        check_sequence_parallel(3, 4)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=1"):  # one process: N = 1 only
        check_sequence_parallel(2, 1)
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        config_checks.check_ranks(GRPOConfig(sequence_parallel_size=4), 2)
    for overrides, named in [({"top_p": 0.9}, "truncated sampling"), ({"routing_replay": True}, "routing_replay=True"),
                             ({"router_aux_loss_coef": 0.01}, "router_aux_loss_coef=0.01")]:
        with pytest.raises(ValueError, match=f"sequence_parallel_size=2 is invalid: expected 1 with {named}"):
            GRPOConfig(sequence_parallel_size=2, **overrides)
    sp.check_model(model, 2)  # 2 query heads, 1 KV head: fits
    with pytest.raises(ValueError, match="2 query heads, 1 KV heads"):
        sp.check_model(model, 4)


def test_the_launcher_refuses_heads_that_do_not_scatter_before_torchrun_starts(tiny_model_dir, tmp_path, capsys):
    """`grpo-fast train --nproc_per_node 3 --sequence_parallel_size 3` on the tiny Llama (2 query heads, 2 KV heads):
    one line, exit status 1, no rank started."""
    from grpo_fast import cli

    code = cli.main(["train", "--nproc_per_node", "3", "--sequence_parallel_size", "3", "--model", tiny_model_dir,
                     "--engine", "hf", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and "2 query heads, 2 KV heads" in err and "sizes that work: 1, 2" in err

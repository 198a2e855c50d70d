"""Packed token-budget micro-batches give the log-probs of separate (padded) forwards."""

import pytest
import torch

from grpo_fast.train.forward import Packer, attention_mode, completion_logprobs
from grpo_fast.train.packing import block_causal_mask, pack_sequences, plan_micro_batches
from tests.helpers import assert_close, scaled
from tests.tiny_model import build_tiny_model, load_tiny_model


def test_plan_respects_budget_and_covers_every_sample():
    lengths = [5, 9, 0, 3, 7, 2, 8]
    plan = plan_micro_batches(lengths, max_tokens=10)
    seen = sorted(i for b in plan for i in b)
    assert seen == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in b) <= 10 for b in plan)
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        plan_micro_batches(lengths, max_tokens=8)


def test_block_causal_mask():
    mask = block_causal_mask([2, 3])[0, 0]
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    expected[2:, 2:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert torch.equal(mask, expected)


def test_pack_layout_targets_predicted_one_position_earlier():
    mb = pack_sequences([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], [0, 1])
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 4, 9, 10]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.hidden_index[0, :2].tolist() == [2, 3] and mb.hidden_index[1].tolist() == [4, 5, 6]
    assert mb.target_ids.tolist() == [[7, 8, 0], [9, 10, 11]]
    assert mb.completion_mask.tolist() == [[True, True, False], [True, True, True]]


def _padded_reference_logprobs(model, prompts, completions, temperature):
    """Right-padded batch forward with materialised logits (the plain way), float64 log-softmax."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        pos = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        out.append(logp[i, pos, torch.tensor(c)])
    return out


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory):
    """Grouped-query attention (4 query heads share 2 kv heads), as in SmolLM2."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gqa"), hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=2)


@pytest.mark.parametrize("attention", ["packed", "mask"])
@pytest.mark.parametrize("model_kind", ["mha", "gqa"])
def test_packed_logprobs_equal_padded(tiny_path, gqa_path, model_kind, attention):
    """Both ways of keeping packed sequences apart on the CPU: per-sequence SDPA (the default for
    models using transformers' attention interface) and the dense block-diagonal mask."""
    model, _ = load_tiny_model(tiny_path if model_kind == "mha" else gqa_path)
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 7), (12, 3), (3, 11), (8, 1), (6, 6)]
    prompts = [torch.randint(3, 300, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(3, 300, (c,), generator=g).tolist() for _, c in lengths]
    packer = Packer(model, max_tokens=24)  # several micro-batches, each holding several sequences
    assert attention_mode(model) == "packed"  # what the trainer picks for these models
    packer.attention = attention
    assert len(list(packer.micro_batches(prompts, completions))) >= 2
    got = completion_logprobs(model, packer, prompts, completions, temperature=0.7, backend="torch")
    want = _padded_reference_logprobs(model, prompts, completions, 0.7)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, atol=scaled(2e-5, b), name=f"sample {i} log-probs")


def test_bf16_autocast_forward_is_close_to_float32(tiny_path):
    """mixed_precision="bf16": the decoder runs under autocast (its matmuls in bf16), the hidden states
    come back in float32 for the fused op, and log-probs stay within bf16 rounding of float32 (measured: mean |diff| 0.008, max 0.02)."""
    model, _ = load_tiny_model(tiny_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 9)]
    completions = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (6, 3)]
    fp32 = completion_logprobs(model, Packer(model, max_tokens=64), prompts, completions, temperature=1.0, backend="torch")
    amp = completion_logprobs(model, Packer(model, max_tokens=64, amp_dtype=torch.bfloat16), prompts, completions,
                              temperature=1.0, backend="torch")
    diff = torch.cat([(a - b).abs() for a, b in zip(amp, fp32, strict=True)])
    assert all(a.dtype == torch.float32 for a in amp)
    assert diff.max() > 0, "autocast changed nothing: the decoder did not run in bf16"
    assert diff.mean() < 0.05, f"bf16 autocast log-probs too far from float32: mean |diff| {diff.mean():.3g}"


def test_packed_attention_refuses_what_it_does_not_implement():
    """Soft-capping, attention sinks and a sliding window shorter than a sequence are refused, not
    silently dropped; a window no sequence reaches changes nothing."""
    from grpo_fast.train.attention import packed_sdpa_forward

    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 32, generator=g) for _ in range(3))
    starts = torch.tensor([0, 3, 7], dtype=torch.int32)
    plain, _ = packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=starts)
    windowed, _ = packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=starts, sliding_window=4)
    assert torch.equal(plain, windowed) and plain.shape == (1, 7, 2, 32)
    for extra in ({"softcap": 50.0}, {"s_aux": torch.zeros(2)}, {"sliding_window": 3}):
        with pytest.raises(NotImplementedError, match="packed attention"):
            packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=starts, **extra)
    module.is_causal = False
    with pytest.raises(NotImplementedError, match="non-causal"):
        packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=starts)

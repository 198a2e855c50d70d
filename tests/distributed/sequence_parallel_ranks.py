"""Run by torchrun (tests/distributed/test_sequence_parallel.py): sequence parallelism's checks on the ranks of one
group, and trainer runs, one after another in one launch (jobs separated by `+`, as train_ranks.py):

    sequence_parallel_ranks.py MODEL_DIR checks OUT [+ OUT PER_DEVICE ENGINE [name=value ...] ...]

`checks OUT`: every rank is one of N = WORLD_SIZE shards of the rows of `ROWS`; each rank writes
OUT/checks-rank<r>.json with, per check, the largest relative difference against the unsharded computation that
every rank also runs alone:
- decoder: the tiny Llama's hidden states and parameter gradients through Ulysses (per-sequence SDPA; the dense mask
  path with sdpa and eager attention; KV heads repeated where N > KV heads; gradient checkpointing); the sharded
  zero pass of train/step.py (its gradients 0: "grad" is the largest);
- loss/<type>[/sequence]: each loss type's sharded loss (log-probs summed over the group, the spec on whole rows)
  against `ops.fused_linear_grpo_loss` unsharded: loss, every metric, the hidden states' and lm_head's gradients,
  with β > 0, an entropy bonus, IS weights (vespo: its IS ratio) and a shard whose tokens are all masked.
The other jobs are train_ranks.py's (`train_ranks.run`)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# each row: (prompt length, completion length) per sequence; the cases of the issue, for N = 2 and N = 3
ROWS = {
    "edge_between_sequences": [(3, 6), (2, 7)],  # 16 tokens: the first sequence ends at N = 2's shard edge
    "edge_inside_a_sequence": [(3, 10), (2, 5)],  # 18 tokens: position 8 (shard 0's last) predicts position 9's token
    "not_divisible": [(3, 5)],  # 7 tokens: N = 2 pads one, N = 3 two
    "prompt_only_shard": [(10, 3)],  # 12 tokens: N = 2's shard 0 holds prompt tokens only
    "longer_than_a_shard": [(2, 11), (2, 3)],  # a 12-token sequence in a 16-token row
    "spanning_every_shard": [(4, 14)],  # one 17-token sequence over all N shards
}


def row(case: str, vocab: int, seed: int = 0):
    """(prompt_ids, completion_ids) of a case, token ids >= 3 (random, seeded: every rank alike)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    pairs = [(draw(p), draw(c)) for p, c in ROWS[case]]
    return [p for p, _ in pairs], [c for _, c in pairs]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for two zero tensors)."""
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return 0.0 if scale == 0 else float((a - b).abs().max()) / scale


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    from tests.tiny_model import tiny_llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).float()


def decoder_checks(group, results: dict) -> None:
    """Ulysses around each attention path: hidden states and the summed parameter gradients equal unsharded."""
    from grpo_fast.train import sequence_parallel as sp
    from grpo_fast.train.forward import completion_hidden
    from grpo_fast.train.packing import pack_sequences

    variants = {
        "packed": ({}, "packed", False),
        "packed/kv_repeated": ({"num_key_value_heads": 1}, "packed", False),
        "packed/checkpointing": ({}, "packed", True),
        "mask/sdpa": ({}, "mask", False),
        "mask/eager": ({"attn_implementation": "eager"}, "mask", False),
    }
    for name, (overrides, mode, checkpointing) in variants.items():
        model = tiny_llama(**overrides).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base = model.model
        worst = {"hidden": 0.0, "grad": 0.0}
        for case in ROWS:
            prompts, completions = row(case, model.config.vocab_size)
            mb = pack_sequences(prompts, completions, list(range(len(prompts))), attention="mask")
            probe = torch.randn(*mb.target_ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
            model.zero_grad()
            whole = completion_hidden(base, mb)  # one process's path: the dense mask
            (whole * probe * mb.completion_mask[..., None]).sum().backward()
            expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad()
            mine = sp.shard(pack_sequences(prompts, completions, list(range(len(prompts))), attention=mode), group, base)
            with sp.attending(base, mine):
                hidden = completion_hidden(base, mine)  # [1, n_own, H]: this rank's positions
                (hidden * mine.own(probe)).sum().backward()
            worst["hidden"] = max(worst["hidden"], rel(hidden[0], whole[mine.owned]))
            for n, p in model.named_parameters():
                dist.all_reduce(p.grad, group=group.handle)
                worst["grad"] = max(worst["grad"], rel(p.grad, expected[n]))
        results[f"decoder/{name}"] = worst
    # the pass a rank with fewer micro-batches runs to meet FSDP2's collectives (train/step.py): sharded too
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.step import _zero_backward

    model = tiny_llama().train()
    model.zero_grad()
    _zero_backward(model, None, model.model, Packer(model, 64), group)
    results["decoder/zero_backward"] = {"grad": max(float(p.grad.abs().max()) for p in model.parameters())}


def loss_checks(group, results: dict) -> None:
    """Each loss type sharded against the fused op unsharded, on every case of ROWS (one with a fully masked shard)."""
    from grpo_fast.loss_types import LOSS_TYPES
    from grpo_fast.objective import LossOptions
    from grpo_fast.ops import fused_linear_grpo_loss
    from grpo_fast.train import sequence_parallel as sp
    from grpo_fast.train.packing import pack_sequences

    vocab, width, n = 320, 32, group.size
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(vocab, width, generator=g) * 0.3
    for name in LOSS_TYPES:
        for level in ("token", "sequence"):
            worst = {"loss": 0.0, "metrics": 0.0, "grad_hidden": 0.0, "grad_weight": 0.0}
            options = LossOptions(loss_type=name, beta=0.05, entropy_coef=0.01, importance_sampling_level=level,
                                  max_completion_length=16, use_bias_correction_kl=True)
            for case in ROWS:
                prompts, completions = row(case, vocab)
                mb = pack_sequences(prompts, completions, list(range(len(prompts))), attention="packed")
                mine = sp.shard(mb, group, None)
                b, t = mb.target_ids.shape
                rows_hidden = torch.randn(-(-mb.num_tokens // n) * n, width, generator=g)
                mask = mb.completion_mask.clone()
                if case == "edge_inside_a_sequence":  # the last rank's tokens all masked out of the loss
                    mask &= ~sp.shard(mb, sp.Group(n - 1, n, None), None).owned
                inputs = dict(advantages=torch.randn(b, generator=g), mask=mask,
                              old_logp=-torch.rand(b, t, generator=g) * 3, ref_logp=-torch.rand(b, t, generator=g) * 3,
                              num_items_in_batch=mask.sum(), options=options)
                ratio = torch.rand(b, t, generator=g) + 0.5
                inputs["is_ratio" if LOSS_TYPES[name].takes_is_ratio else "is_weights"] = ratio
                whole_hidden = rows_hidden.clone().requires_grad_(True)
                whole_weight = weight.clone().requires_grad_(True)
                loss, metrics = fused_linear_grpo_loss(whole_hidden[mb.hidden_index], whole_weight, mb.target_ids, **inputs)
                loss.backward()
                start = group.rank * mine.shard_inputs["input_ids"].shape[1]
                part = rows_hidden[start: start + mine.shard_inputs["input_ids"].shape[1]].clone().requires_grad_(True)
                part_weight = weight.clone().requires_grad_(True)
                sharded, sharded_metrics = sp.loss_of(mine)(part[mine.hidden_index], part_weight, mb.target_ids, **inputs)
                sharded.backward()
                dist.all_reduce(part_weight.grad, group=group.handle)
                worst["loss"] = max(worst["loss"], rel(sharded, loss))
                worst["metrics"] = max([worst["metrics"], *(rel(sharded_metrics[k], metrics[k]) for k in metrics)])
                # (each rank's gradient is N times its share: DDP / FSDP2 average over the group's N ranks)
                worst["grad_hidden"] = max(worst["grad_hidden"],
                                           rel(part.grad / n, whole_hidden.grad[start: start + part.shape[0]]))
                worst["grad_weight"] = max(worst["grad_weight"], rel(part_weight.grad / n, whole_weight.grad))
            results[f"loss/{name}/{level}"] = worst


def checks(out: str) -> None:
    from grpo_fast.train.sequence_parallel import Group

    rank, size = dist.get_rank(), dist.get_world_size()
    group = Group(rank, size, dist.new_group(list(range(size))))
    results: dict = {}
    decoder_checks(group, results)
    loss_checks(group, results)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"checks-rank{rank}.json").write_text(json.dumps(results))


def main(model_dir: str, *argv: str) -> None:
    from tests.distributed import train_ranks

    torch.set_num_threads(1)
    jobs = [[]]
    for arg in argv:
        jobs.append([]) if arg == "+" else jobs[-1].append(arg)
    for job in jobs:
        if job[0] == "checks":
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            checks(job[1])
        else:
            train_ranks.run(model_dir, job[0], int(job[1]), job[2], *job[3:])


if __name__ == "__main__":
    main(*sys.argv[1:])

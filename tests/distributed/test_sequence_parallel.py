"""Sequence parallelism (Ulysses, N = 2) on 2 gloo ranks against one process with the same global batch (HF engine):
the same samples, every logged metric but timings within 1e-5 relative, the same update within 1e-5 relative.

Two launches: one plain process (in this one) for the references, one torchrun of 2 ranks (one sequence-parallel
group) for the checks of tests/distributed/sequence_parallel_ranks.py (Ulysses around each attention path, every loss
type sharded against the fused op unsharded) and the trainer runs: a token-level loss (dapo, DDP), a sequence-level
one (luspo with GSPO's sequence ratio, FSDP2, β > 0, num_iterations 2, gradient checkpointing) and a LoRA adapter
(β > 0: the reference is the policy with its adapter off)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed import train_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "sequence_parallel_ranks.py")
SP = "sequence_parallel_size=2"
FAST = ["eval_before_train=False"]  # (the final evaluation runs: the engine samples under each layout)
SEQUENCE_LEVEL = ["loss_type=luspo", "importance_sampling_level=sequence", "num_iterations=2", "beta=0.05"]
# A LoRA adapter's update is AdamW's first step, lr x g / (|g| + eps) per element: where |g| is near eps (1e-8) it
# follows the float noise of g whatever changes the layout (measured, one step: plain 2-rank DP without sequence
# parallelism 3.8e-4 of the update, N = 2 1.6e-4): held to test_trainer_ranks.py's LoRA bound, 1e-3. One step: the
# second amplifies that into the metrics (step 2's loss: DP 3.4e-5, N = 2 1.4e-5)
LORA = ["use_peft=True", "lora_r=4", "beta=0.05", "max_steps=1"]
LORA_UPDATE = 1e-3
TOLERANCE = 1e-5  # relative, the update and every metric (the bound; measured: below 7e-6, LoRA's update below)
RUNS = {"sp": ("one", ["distributed_strategy=ddp"], []),
        # gradient checkpointing on the ranks only: one process then takes the dense-mask attention, whose float sums
        # move its own update by 2.9e-5 against its per-sequence SDPA (measured); the ranks keep the per-sequence SDPA
        # under checkpointing (bitwise the run without)
        "sp-sequence": ("one-sequence", ["distributed_strategy=fsdp2", "gradient_checkpointing=True"], SEQUENCE_LEVEL),
        "sp-lora": ("one-lora", ["distributed_strategy=ddp"], LORA)}
# float noise of two forwards of the same weights (the HF engine's sampling pass and the trainer's): ~1e-6 on both
# sides, not equal value for value whatever the layout (tests/distributed/test_trainer_ranks.py's rule)
NOISE = ("sampling/logp_diff_mean", "sampling/logp_diff_max")


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """{name: (folder, metrics lines, final weights)} of every run, and the checks' results per rank."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    for one, _, overrides in RUNS.values():  # one process, in this one
        train_ranks.main(tiny_model_dir, str(root / one), "16", "hf", *FAST, *overrides)
    args = ["checks", str(root / "checks")]
    for sharded, (_, layout, overrides) in RUNS.items():
        args += ["+", str(root / sharded), "8", "hf", *layout, SP, *FAST, *overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           tiny_model_dir, *args]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = {}
    for sharded, (one, _, _) in RUNS.items():
        for name in (one, sharded):
            out = root / name
            final = out / "final" / "model.safetensors"
            runs[name] = (out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
                          load_file(final if final.exists() else out / "final" / "adapter_model.safetensors"))
    checks = [json.loads((root / "checks" / f"checks-rank{r}.json").read_text()) for r in range(2)]
    return runs, checks


def test_ulysses_attention_paths_equal_the_unsharded_decoder(launched):
    """Hidden states and summed parameter gradients of the tiny Llama through each attention path (per-sequence SDPA,
    KV heads repeated, gradient checkpointing's recompute, the dense mask with sdpa and eager) on rows cut at shard
    edges, not divisible by N, with a prompt-only shard, a sequence longer than a shard and one spanning both."""
    _, checks = launched
    names = [n for n in checks[0] if n.startswith("decoder/")]
    assert len(names) == 6  # (and the sharded zero pass of a rank with fewer micro-batches: its gradients 0)
    for rank in checks:
        for name in names:
            assert max(rank[name].values()) <= TOLERANCE, (name, rank[name])


def test_every_loss_type_sharded_equals_the_fused_loss_unsharded(launched):
    """Loss, metrics and gradients (hidden states, lm_head) of every loss type at token and sequence level, with
    β > 0, an entropy bonus, IS weights and a shard whose tokens are all masked out of the loss."""
    from grpo_fast.loss_types import LOSS_TYPES

    _, checks = launched
    assert {n for n in checks[0] if n.startswith("loss/")} == {f"loss/{t}/{level}" for t in LOSS_TYPES
                                                                for level in ("token", "sequence")}
    for rank in checks:
        for name, worst in rank.items():
            assert max(worst.values()) <= TOLERANCE, (name, worst)


@pytest.mark.parametrize("sharded", list(RUNS))
def test_two_ranks_of_one_sequence_parallel_group_train_like_one_process(launched, tiny_model_dir, sharded):
    runs, _ = launched
    one = RUNS[sharded][0]
    (out1, steps1, weights1), (out2, steps2, weights2) = runs[one], runs[sharded]
    assert _sampled(out2, 2) == _sampled(out1, 1), "2 ranks sample exactly what one process samples"
    assert [s["step"] for s in steps2] == [s["step"] for s in steps1]
    compared = 0
    for a, b in zip(steps1, steps2, strict=True):
        assert sorted(b) == sorted(a), "the ranks log the names one process logs"
        for name, value in a.items():
            if name.startswith("time/") or name in ("step_time", "tokens_per_second") or isinstance(value, (bool, str)):
                continue
            if name in NOISE:
                assert value < 1e-4 and b[name] < 1e-4, (name, value, b[name])
                continue
            assert abs(b[name] - value) <= TOLERANCE * abs(value) + 1e-12, (name, a["step"], value, b[name])
            compared += 1
    assert compared > 40
    initial = load_file(Path(out1) / "initial_adapter.safetensors") if sharded == "sp-lora" else \
        load_file(Path(tiny_model_dir) / "model.safetensors")
    diff = sum(float(((weights2[n] - w) ** 2).sum()) for n, w in weights1.items()) ** 0.5
    update = sum(float(((w - initial[n]) ** 2).sum()) for n, w in weights1.items()) ** 0.5
    bound = LORA_UPDATE if sharded == "sp-lora" else TOLERANCE
    assert update > 0 and diff <= bound * update, f"relative update difference {diff / update:.2e}"


def _sampled(out, world):
    """Per reward call, the completions every rank sampled, as one sorted list."""
    ranks = [json.loads((out / f"sampled-rank{r}.json").read_text()) for r in range(world)]
    return [sorted(tuple(ids) for rank in ranks for ids in rank[call]) for call in range(len(ranks[0]))]

"""How metrics combine over ranks (grpo_fast/reporting/metrics.py: `reduction`, `Pooled`, `combine`), without
launching ranks: a batch split into two rank shares, each share's metrics computed as its rank does,
combined as rank 0 combines the gathered dicts, against one process's metrics of the whole batch."""

import math

import pytest
import torch

from grpo_fast.generation.batch import Rollouts
from grpo_fast.reporting.metrics import Pooled, combine, reduction
from grpo_fast.train.score import reward_metrics
from tests.trainer.common import config


def _close(a: float, b: float, rel: float = 1e-12) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def _assert_same(one: dict, ranks: dict, names) -> None:
    bad = [(n, one[n], ranks[n]) for n in names if not _close(one[n], ranks[n])]
    assert not bad, f"{len(bad)} metric(s) differ between one process and two ranks (name, one, ranks): {bad}"


def _batch(seed: int, n: int = 16) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    rewards = torch.rand(n, 2, generator=g, dtype=torch.float64)
    rewards[3, 1] = rewards[12, 0] = math.nan  # a reward function returned None
    rewards[5, 1] = 10.0  # an outlier on one rank only: a mean of the ranks' stds misses it
    return Rollouts(prompt_ids=[[1]] * n, completion_ids=[[2] * k for k in lengths], sampling_logp=[torch.zeros(k) for k in lengths],
                    finish_reason=["length" if k == 8 else "stop" for k in lengths], completion_texts=[""] * n,
                    rows=[{"prompt": "p"}] * n, rewards=rewards, advantages=torch.randn(n, generator=g))


def test_two_rank_shares_combine_to_one_process_metrics(tmp_path):
    c = config(tmp_path, reward_funcs=["a", "b"], reward_weights=[1.0, 0.5], num_generations=4)
    funcs = [lambda **kw: None, lambda **kw: None]
    funcs[0].__name__, funcs[1].__name__ = "a", "b"
    batch = _batch(0)
    one = combine([reward_metrics(batch, funcs, c) | {"rollout/generated_tokens": 64.0}])
    shares = [reward_metrics(batch.select(range(r * 8, (r + 1) * 8)), funcs, c) | {"rollout/generated_tokens": 32.0}
              for r in range(2)]
    ranks = combine(shares)
    assert set(ranks) == set(one)
    _assert_same(one, ranks, sorted(one))
    assert _close(one["rewards/b/std"], torch.cat([batch.rewards[:3, 1], batch.rewards[4:, 1]]).std().item())
    assert one["rollout/generated_tokens"] == 64.0 and one["completions/max_length"] == max(map(len, batch.completion_ids))
    # the old rule (the mean of the ranks' values) is not what one process logs: the test can tell
    resolved = [combine([s]) for s in shares]
    assert not _close(one["rewards/b/std"], (resolved[0]["rewards/b/std"] + resolved[1]["rewards/b/std"]) / 2, rel=1e-3)


@pytest.mark.parametrize("name, how", [
    ("num_tokens", "sum"), ("tokens_per_second", "sum"), ("rollout/generated_tokens", "sum"), ("rewards/non_finite", "sum"),
    ("completions/max_length", "max"), ("completions/min_length", "min"), ("sampling/logp_diff_max", "max"),
    ("rollout/staleness_max", "max"), ("sampling/importance_sampling_ratio/min", "min"),
    ("sampling/importance_sampling_ratio/max", "max"), ("kl", "mean"), ("clip_ratio/low_mean", "mean"),
    ("entropy_coef", "mean"), ("rollout/staleness_mean", "mean"), ("learning_rate", "mean"),
])
def test_each_scalar_metric_declares_its_reduction(name, how):
    assert reduction(name) == how
    ranks = [{name: 3.0}, {name: 1.0}, {name: math.nan}]  # a rank without a finite value is left out
    assert combine(ranks)[name] == {"sum": 4.0, "max": 3.0, "min": 1.0, "mean": 2.0}[how]


def test_pooled_is_exact_for_unequal_counts_and_missing_values():
    values = torch.tensor([0.1, 5.0, 2.5, math.nan, 1e3, 1e3 + 1.0, 7.0], dtype=torch.float64)
    known = values[~values.isnan()]
    for stat, expected in (("mean", known.mean().item()), ("std", known.std().item())):
        parts = [Pooled.of(values[:1], stat), Pooled.of(values[1:4], stat), Pooled.of(values[4:], stat),
                 Pooled.of(values[:0], stat)]  # a rank with no value
        got = combine([{"x": p} for p in parts])["x"]
        assert _close(got, expected, rel=1e-12), (stat, got, expected)
    assert combine([{"x": Pooled.of([], "std")}])["x"] == 0.0 and math.isnan(combine([{"x": Pooled.of([])}])["x"])
    assert combine([{"x": Pooled.weighted(0.5, 30)}, {"x": Pooled.weighted(2.0, 10)}])["x"] == pytest.approx(0.875, rel=1e-12)


def test_one_process_keeps_its_values():
    metrics = {"loss": 0.25, "skipped_steps": 3, "kl": math.nan, "reward": Pooled.of([1.0, 2.0])}
    assert combine([metrics]) == {"loss": 0.25, "skipped_steps": 3, "kl": metrics["kl"], "reward": 1.5}

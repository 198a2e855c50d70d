"""The score stage: reward functions -> rewards `[n, k]`, the groups without signal, and TRL's per-step
reward metrics (what is logged is what trained: `trained_rewards` where shaping replaced them)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import queue
import threading
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..generation.batch import Rollouts
from ..objective import weighted_rewards
from ..rewards.names import reward_name


def conversational(prompt) -> bool:
    """Whether a dataset prompt is a chat (a list of messages) rather than plain text."""
    return isinstance(prompt, list)


class Scores(NamedTuple):
    rewards: torch.Tensor  # (n, k) float64, NaN = missing
    non_finite: int  # values that were NaN/inf (not None): a reward function's bug, worth a metric
    timeouts: dict  # reward name -> calls past reward_timeout (their values are missing)


def score(reward_funcs: Sequence[Callable], batch: Rollouts, prompt_column: str, conversational: bool, *,
          group_size: int = 1, timeout: Optional[float] = None) -> Scores:
    """The batch's rewards: None and non-finite values become NaN (missing).

    Each function is called as TRL calls it: `f(prompts=, completions=, completion_ids=, **columns)` with
    every other dataset column as a list of one entry per completion; a function with `takes_groups = True`
    once per group of `group_size` consecutive entries, in order, with that group's lists. `async def`
    functions run concurrently with each other on one event loop (TRL's semantics), after the others.
    A call past `timeout` seconds gives no values (cancelled if async; a sync one is left running in a
    daemon thread), counted in `timeouts`. A function that raises, or returns the wrong number of values
    or a non-number, is an error naming it. Thoughts (multi_answer) are not graded: their rows stay NaN.
    """
    if batch.kind is not None and "thought" in batch.kind:  # multi_answer: its answers are graded, not thoughts
        graded = [i for i, kind in enumerate(batch.kind) if kind != "thought"]
        rewards = torch.full((len(batch), len(reward_funcs)), math.nan, dtype=torch.float64)
        inner = score(reward_funcs, batch.select(graded), prompt_column, conversational, timeout=timeout)
        rewards[graded] = inner.rewards
        return Scores(rewards, inner.non_finite, inner.timeouts)
    n = len(batch)
    prompts = [r[prompt_column] for r in batch.rows]
    if conversational:  # (multi_turn: the assistant turns and tool results, as TRL hands them over)
        completions = (list(batch.messages) if batch.messages is not None
                       else [[{"role": "assistant", "content": t}] for t in batch.completion_texts])
    else:
        completions = list(batch.completion_texts)
    columns = {key: [r.get(key) for r in batch.rows] for key in batch.rows[0] if key != prompt_column}
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=batch.completion_ids, **columns)
    if batch.environments is not None:  # (TRL's: reward functions see each completion's environment)
        kwargs["environments"] = list(batch.environments)
    calls = {}  # function index -> [(slice, kwargs)]: one call, or one per group
    for j, func in enumerate(reward_funcs):
        parts = [slice(s, s + group_size) for s in range(0, n, group_size)] if getattr(func, "takes_groups", False) else [slice(0, n)]
        calls[j] = [(part, {k: v[part] for k, v in kwargs.items()}) for part in parts]
    results = {j: [_call_sync(reward_funcs[j], kw, timeout) for _, kw in calls[j]]
               for j in calls if not is_async(reward_funcs[j])}
    asynchronous = [j for j in calls if j not in results]
    if asynchronous:
        results.update(_run(_call_async({j: (reward_funcs[j], [kw for _, kw in calls[j]]) for j in asynchronous},
                                        timeout)))
    rewards = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float64)
    non_finite, timeouts = 0, {}
    for j, func in enumerate(reward_funcs):
        name = reward_name(func)
        for (part, _), values in zip(calls[j], results[j], strict=True):
            if isinstance(values, BaseException):
                raise RuntimeError(f"reward function {name!r} raised {type(values).__name__}: {values}") from values
            if values is _TIMED_OUT:
                timeouts[name] = timeouts.get(name, 0) + 1
                continue
            non_finite += _fill(rewards, j, part, values, name, len(range(n)[part]))
    return Scores(rewards, non_finite, timeouts)


_TIMED_OUT = object()


class GroupScorer:
    """Scores a generation batch group by group while the engine still decodes the rest: `on_group(key,
    group)` (the engine's callback) queues a finished group; a worker thread scores whatever groups are
    queued each time it is free (several at once, one call per reward function, as `score` calls them), so
    the reward functions' time hides behind decoding. `finish(keys)` waits for the last ones and returns
    the `Scores` of the groups `keys`, in that order (G rows each).

    make_batch(keys, groups) -> the Rollouts of those groups, in order (the synchronous stage hands over
    the engine's groups of Completion, partial rollouts a group's Rollouts). Results equal `score` on the
    whole batch for reward functions that score each completion (or, with takes_groups, each group) on
    its own, which is TRL's contract for them."""

    def __init__(self, reward_funcs: Sequence[Callable], make_batch: Callable, prompt_column: str, conversational: bool,
                 *, group_size: int, timeout: Optional[float] = None):
        self._args = (reward_funcs, prompt_column, conversational, group_size, timeout)
        self._make_batch, self._queue, self._done, self._error = make_batch, queue.Queue(), {}, None
        self._handed: set = set()
        self._threads = torch.get_num_threads()  # (the worker's OpenMP count starts at the default; vLLM's CPU
        #   attention checks that it is the count the engine was built with, so a judge called from it must agree)
        self._worker = threading.Thread(target=self._work, daemon=True, name="grpo_fast group scorer")
        self._worker.start()

    def close(self) -> None:
        """Let the worker end after what it is scoring (the stage failed: nothing will be finished)."""
        self._queue.put(None)

    def on_group(self, key, group) -> None:
        self._handed.add(key)
        self._queue.put((key, group))

    def _work(self) -> None:
        funcs, column, chat, G, timeout = self._args
        torch.set_num_threads(self._threads)
        end = False
        while not end:
            items = [self._queue.get()]
            while not self._queue.empty():  # everything finished meanwhile: one call
                items.append(self._queue.get())
            end = items[-1] is None
            items = [item for item in items if item is not None]
            if not items or self._error is not None:
                continue
            try:
                scores = score(funcs, self._make_batch([i for i, _ in items], [g for _, g in items]), column, chat,
                               group_size=G, timeout=timeout)
            except BaseException as err:  # (raised by finish(), in the trainer's thread)
                self._error = err
                continue
            for k, (i, _) in enumerate(items):
                self._done[i] = Scores(scores.rewards[k * G:(k + 1) * G], 0, {})
            first = items[0][0]  # the call's counters go with its first group
            self._done[first] = self._done[first]._replace(non_finite=scores.non_finite, timeouts=scores.timeouts)

    def finish(self, keys, late: Optional[dict] = None, known: Optional[dict] = None) -> Scores:
        """The Scores of the groups `keys`, in order (waiting for the worker); `known`: key -> Scores already
        had (a group scored in an earlier round); `late`: key -> group for the others never handed over,
        scored now. A reward function's error is re-raised here, in the caller's thread. Afterwards `scored`
        holds every group's Scores, the ones not asked for too."""
        self._done.update(known or {})
        for key, group in (late or {}).items():
            if key not in self._handed and key not in self._done:
                self.on_group(key, group)
        self._queue.put(None)
        self._worker.join()
        if self._error is not None:
            raise self._error
        keys = list(keys)
        missing = [k for k in keys if k not in self._done]
        assert not missing, f"groups never handed to the scorer: {missing}"
        parts = [self._done[k] for k in keys]
        self.scored = dict(self._done)
        timeouts: dict = {}
        for p in parts:
            for name, count in p.timeouts.items():
                timeouts[name] = timeouts.get(name, 0) + count
        return Scores(torch.cat([p.rewards for p in parts]), sum(p.non_finite for p in parts), timeouts)


COUNTER_PREFIXES = ("judge/", "sandbox/", "code/")  # what reward functions' counters log (never time/: see judge.py)


def counter_metrics(reward_funcs: Sequence[Optional[Callable]]) -> dict:
    """The counters since the last call of the reward functions that keep some (`f.counters.metrics()`: a
    judge's judge/*, code_tests' sandbox/* and code/*), summed over the distinct counter objects."""
    sources = {id(k): k for f in reward_funcs if (k := getattr(f, "counters", None)) is not None}
    out: dict = {}
    for source in sources.values():
        for name, value in source.metrics().items():
            out[name] = out.get(name, 0) + value
    return out


def is_async(func) -> bool:
    """An `async def` reward function, or an object whose __call__ is one (code_tests)."""
    return inspect.iscoroutinefunction(func) or (not inspect.isroutine(func) and callable(func)
                                                 and inspect.iscoroutinefunction(type(func).__call__))


def _run(coroutine):
    """asyncio.run, also where this thread already runs an event loop (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (its calls are bounded by the timeout or by nothing, as here)
        return pool.submit(asyncio.run, coroutine).result()


def _call_sync(func, kwargs, timeout):
    """func(**kwargs), or its exception, or _TIMED_OUT when it runs past `timeout` (then left running in a
    daemon thread: Python cannot stop a thread, and a daemon one does not hold up the process's exit)."""
    if timeout is None:
        try:
            return func(**kwargs)
        except Exception as err:
            return err
    out = [_TIMED_OUT]

    def run():
        try:
            out[0] = func(**kwargs)
        except Exception as err:
            out[0] = err

    thread = threading.Thread(target=run, daemon=True, name=f"reward {reward_name(func)}")
    thread.start()
    thread.join(timeout)
    return _TIMED_OUT if thread.is_alive() else out[0]


async def _call_async(calls: dict, timeout) -> dict:
    """{j: (async func, [kwargs per call])} -> {j: [values, exception or _TIMED_OUT per call]}, all at once."""
    async def one(func, kwargs):
        try:
            return await asyncio.wait_for(func(**kwargs), timeout)
        except asyncio.TimeoutError:
            return _TIMED_OUT
        except Exception as err:
            return err

    order = [(j, kwargs) for j, (_, many) in calls.items() for kwargs in many]
    done = await asyncio.gather(*(one(calls[j][0], kwargs) for j, kwargs in order))
    out: dict = {j: [] for j in calls}
    for (j, _), values in zip(order, done, strict=True):
        out[j].append(values)
    return out


def _fill(rewards: torch.Tensor, j: int, part: slice, values, name: str, n: int) -> int:
    """Write one call's values into column j's rows `part`; the count of non-finite values."""
    if values is None or not hasattr(values, "__len__") or len(values) != n:
        got = "None" if values is None else (f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__)
        raise ValueError(f"reward function {name!r} must return one value per completion ({n}), got {got}")
    non_finite = 0
    for i, v in zip(range(rewards.shape[0])[part], values, strict=True):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
            raise ValueError(f"reward function {name!r} returned {v!r} (type {type(v).__name__}) for completion {i}; expected a float or None")
        v = float(v)
        if math.isfinite(v):
            rewards[i, j] = v
        else:
            non_finite += 1
    return non_finite


def zero_std_groups(rewards: torch.Tensor, weights, num_generations: int) -> torch.Tensor:
    """(G,) bool: groups whose known weighted rewards all agree (no learning signal)."""
    total = weighted_rewards(rewards, weights).view(-1, num_generations)
    known = ~total.isnan()
    lo = torch.where(known, total, math.inf).min(dim=1).values
    hi = torch.where(known, total, -math.inf).max(dim=1).values
    return ~(hi - lo > 1e-9)


def weighted_mean(rewards: torch.Tensor, weights) -> float:
    total = weighted_rewards(rewards, weights)
    known = total[~total.isnan()]
    return known.mean().item() if known.numel() else float("nan")


def reward_metrics(batch: Rollouts, reward_funcs: Sequence[Callable], options) -> dict:
    """TRL's per-step reward and completion metrics for the completions of one step. `reward`,
    `reward_std` and `frac_reward_zero_std_step` are of the rewards the advantages came from
    (`batch.trained_rewards`: partial credit, early_exit's serial reward), `rewards/<func>/*` of each
    function's values as scored. Means and stds over values are `Pooled`: on many ranks they are of
    all ranks' values (metrics.py). options: the advantages stage's (`advantages.AdvantageOptions`)."""
    from ..reporting.metrics import Pooled

    G = options.group_size
    trained = batch.rewards if batch.trained_rewards is None else batch.trained_rewards
    total = weighted_rewards(trained, options.reward_weights)
    groups = total.view(-1, G)
    group_std = torch.stack([g[~g.isnan()].std() if (~g.isnan()).sum() > 1 else g.new_zeros(()) for g in groups])
    lengths = batch.model_lengths()  # (multi_turn: the model's tokens only, as TRL)
    clipped = torch.tensor([r == "length" for r in batch.finish_reason], dtype=torch.float32)
    m = {
        "reward": Pooled.of(total),
        "reward_std": Pooled.of(group_std),  # the mean of the groups' stds
        "frac_reward_zero_std_step": Pooled.of(zero_std_groups(trained, options.reward_weights, G).double()),
        "completions/mean_length": Pooled.of(lengths),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": Pooled.of(clipped),
        "advantages/abs_mean": Pooled.of(batch.advantages.abs()),
    }
    for j, f in enumerate(reward_funcs):
        m[f"rewards/{reward_name(f)}/mean"] = Pooled.of(batch.rewards[:, j])
        m[f"rewards/{reward_name(f)}/std"] = Pooled.of(batch.rewards[:, j], "std")
    return m

"""The multi-turn loop: trajectories that alternate sampled turns and tool results, token-exact.

A trajectory is one trained sample (TRL's semantics): the prompt, then the model's turns and the tool
results as one completion. Its tokens carry a mask (1: sampled by the model; 0: tool results and the
template's tokens between turns) and a sampling log-prob (NaN where the mask is 0), so the loss, the
IS ratios and the mismatch metrics see the model's tokens only.

A turn ends the trajectory when it has no call, ends by length, or calls again after
`max_tool_calling_iterations` rounds of results (its calls do not run); a tool result that would overflow `max_completion_length` (every completion token counts,
tool results too) or the engine's `max_model_len` ends it before the result is appended (TRL's roll-back).
A turn whose call markup does not parse is answered with an error result (`malformed`).

Two drivers, one bookkeeping:
- an engine with a request loop (vLLM: `generate_until`) never waits for a tool: a trajectory's calls
  start the moment its turn finishes, and its next turn joins the running batch as soon as they return,
  while the engine keeps decoding the others; only when every live trajectory waits on a tool does
  the loop wait (the time counted in `tools/time_waiting`);
- otherwise (the HF engine) turns run in lock-step: every live trajectory's turn, then all their tools.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from ..rollout.base import Continuation, SamplingOptions, hashed_seed
from .chat import ChatTemplate
from .tools import Calls, ToolRunner

MALFORMED = "error: the tool call is not valid JSON"  # (short: it counts against max_completion_length)


@dataclass
class Trajectory:
    """One sample's conversation after its prompt, as token ids and as messages."""

    prompt_ids: list[int]
    seed: int
    tools: Optional[dict] = None  # this trajectory's tools by name (an environment's); None: the runner's
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the assistant and tool messages of the completion
    finish_reason: Optional[str] = None
    turns: int = 0
    rounds: int = 0  # tool rounds: turns answered with tool results
    calls: int = 0
    failures: int = 0
    malformed: int = 0
    truncated: int = 0
    done: bool = False
    pending: Optional[Calls] = None  # the calls of its last turn, running
    turn_ends: list[float] = field(default_factory=list)  # monotonic time each turn finished (the engine's log)

    @property
    def running_ids(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass(frozen=True)
class LoopOptions:
    max_completion_length: int
    max_tool_calling_iterations: Optional[int]  # None: no limit
    max_tool_response_tokens: int
    sampling: SamplingOptions


class AgentLoop:
    def __init__(self, engine, tokenizer, chat: ChatTemplate, runner: ToolRunner, options: LoopOptions):
        self.engine, self.tokenizer, self.chat, self.runner, self.o = engine, tokenizer, chat, runner, options
        self.waiting_seconds = 0.0  # tool time no decoding overlapped (the whole loop's)

    # ---- one turn's bookkeeping ----------------------------------------------------------------

    def budget(self, t: Trajectory) -> int:
        """Tokens the next turn may add: the completion budget and the engine's context, whichever is less."""
        return min(self.o.max_completion_length - len(t.ids), self.engine.max_model_len - len(t.running_ids))

    def _turn_done(self, t: Trajectory, token_ids: list[int], logprobs: list[float], finish_reason: str) -> None:
        """Append a sampled turn; start its calls, or end the trajectory."""
        prefix = t.running_ids
        t.ids += token_ids
        t.logp += [float(x) for x in logprobs]
        t.mask += [True] * len(token_ids)
        t.turns += 1
        t.turn_ends.append(time.monotonic())
        t.finish_reason = finish_reason
        if finish_reason == "stop":
            content, calls, malformed = self.chat.parse(token_ids, prefix)
        else:  # (cut by the budget: no call runs)
            content, calls, malformed = self.tokenizer.decode(token_ids, skip_special_tokens=True), [], False
        t.messages.append({"role": "assistant", "content": content,
                           **({"tool_calls": [{"type": "function", "function": c} for c in calls]} if calls else {})})
        limit = self.o.max_tool_calling_iterations
        if finish_reason != "stop" or not (calls or malformed) or (limit is not None and t.rounds >= limit) \
                or self.budget(t) < 1:
            t.done = True
            return
        t.malformed += malformed
        t.calls += len(calls)
        t.pending = self.runner.start(calls, t.tools) if calls else None

    def _results_in(self, t: Trajectory) -> Optional[Continuation]:
        """The finished calls' results appended (masked); the next turn's request, or None when it ended."""
        if t.pending is None:  # a malformed turn: one error result (counted as malformed, not as a failed call)
            messages = [{"role": "tool", "name": "invalid_call", "content": MALFORMED}]
        else:
            results = t.pending.results(self.runner.timeout)
            t.failures += sum(r.failed for r in results)
            messages = [{"role": "tool", "name": r.name, "content": self._cut(r.content, t)} for r in results]
        t.pending = None
        t.rounds += 1
        between = self.chat.between_turns(messages)
        if len(t.ids) + len(between) >= self.o.max_completion_length \
                or len(t.running_ids) + len(between) >= self.engine.max_model_len:
            t.done = True  # (rolled back: the results would leave no room for a turn)
            return None
        t.ids += between
        t.logp += [math.nan] * len(between)
        t.mask += [False] * len(between)
        t.messages += messages
        return Continuation(prompt_ids=t.running_ids, max_new_tokens=self.budget(t), seed=hashed_seed(t.seed, t.turns))

    def _cut(self, content: str, t: Trajectory) -> str:
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if len(ids) <= self.o.max_tool_response_tokens:
            return content
        t.truncated += 1
        return self.tokenizer.decode(ids[: self.o.max_tool_response_tokens])

    # ---- drivers -------------------------------------------------------------------------------

    def run(self, trajectories: list[Trajectory], lockstep: bool = False) -> list[Trajectory]:
        """Run the trajectories to their ends. lockstep: turns in lock-step even on an engine with a request loop
        (benchmarks/bench_agents.py compares the two)."""
        if getattr(self.engine, "runs_partial_rollouts", False) and not lockstep:
            self._run_streaming(trajectories)
        else:
            self._run_lockstep(trajectories)
        return trajectories

    def _first(self, t: Trajectory) -> Continuation:
        return Continuation(prompt_ids=t.running_ids, max_new_tokens=self.budget(t), seed=hashed_seed(t.seed, 0))

    def _run_lockstep(self, trajectories: list[Trajectory]) -> None:
        requests = {i: self._first(t) for i, t in enumerate(trajectories)}
        while requests:
            order = list(requests)
            groups = self.engine.generate([requests[i].prompt_ids for i in order], n=1,
                                          max_new_tokens=max(requests[i].max_new_tokens for i in order),
                                          sampling=self.o.sampling, seed=[requests[i].seed for i in order])
            for i, (c,) in zip(order, groups, strict=True):
                budget = requests[i].max_new_tokens  # (one call, one max_new_tokens: cut to this one's budget)
                reason = "length" if len(c.token_ids) > budget else c.finish_reason
                self._turn_done(trajectories[i], c.token_ids[:budget], c.logprobs[:budget], reason)
            started = time.monotonic()
            for i in order:
                if trajectories[i].pending is not None:
                    trajectories[i].pending.wait()
            self.waiting_seconds += time.monotonic() - started
            requests = {}
            for i in order:
                t = trajectories[i]
                if not t.done:
                    nxt = self._results_in(t)
                    if nxt is not None:
                        requests[i] = nxt

    def _run_streaming(self, trajectories: list[Trajectory]) -> None:
        waiting: list[int] = []  # trajectories whose calls run
        slots: list[int] = []  # the trajectory of each request of the current round

        def ready() -> list[Continuation]:
            """The next turns of the trajectories whose calls returned (each a request of the round)."""
            out = []
            for i in [i for i in waiting if trajectories[i].pending is None or trajectories[i].pending.ready()]:
                waiting.remove(i)
                nxt = self._results_in(trajectories[i])
                if nxt is not None:
                    slots.append(i)
                    out.append(nxt)
            return out

        def finished(k: int, c) -> None:
            t = trajectories[slots[k]]
            self._turn_done(t, c.token_ids, c.logprobs, c.finish_reason)
            if not t.done:
                waiting.append(slots[k])

        requests = []
        for i, t in enumerate(trajectories):
            slots.append(i)
            requests.append(self._first(t))
        while requests:
            self.engine.generate_until(requests, lambda f: False, more=lambda f: ready(),
                                       sampling=self.o.sampling, on_finished=finished)
            slots.clear()
            started = time.monotonic()
            requests = ready()
            while not requests and waiting:  # every live trajectory waits on a tool: the only wait
                time.sleep(0.001)
                requests = ready()
            self.waiting_seconds += time.monotonic() - started

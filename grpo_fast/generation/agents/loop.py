"""The multi-turn loop: trajectories that alternate sampled turns and tool results, token-exact.

A trajectory is one trained sample (TRL's semantics): the prompt, then the model's turns and the tool
results as one completion. Its tokens carry a mask (1: sampled by the model; 0: tool results and the
template's tokens between turns) and a sampling log-prob (NaN where the mask is 0), so the loss, the
IS ratios and the mismatch metrics see the model's tokens only.

A turn ends the trajectory when it has no call, ends by length, or calls again after
`max_tool_calling_iterations` rounds of results (its calls do not run); a tool result that would overflow `max_completion_length` (every completion token counts,
tool results too) or the engine's `max_model_len` ends it before the result is appended (TRL's roll-back).
A turn whose call markup does not parse is answered with an error result (`malformed`).

Nothing a tool returns ends the run: whatever fails between a call and the tokens of its result (the tool
raised, its result's str() raised, its text cannot be tokenized or rendered) is a counted failed call
answered with an error result (`_tool_message`, `results_in`). A result is rendered as untrusted text
(chat.py): its special tokens' strings stay text. A trajectory whose environment's reset raised
(`reset_failed`, environments.py) samples nothing: its completion is one masked end-of-turn token.

Two drivers, one bookkeeping:
- an engine with a request loop (vLLM: `generate_until`) never waits for a tool (`stream`): a trajectory's
  calls start the moment its turn finishes, and its next turn joins the running batch as soon as they
  return, while the engine keeps decoding the others; only when every live trajectory waits on a tool does
  the loop wait (the time counted in `tools/time_waiting`). Partial rollouts (rounds.py) drive the same
  loop with a round's end: a turn stopped by it keeps its tokens (`carry`), running calls go on;
- otherwise (the HF engine) turns run in lock-step: every live trajectory's turn, then all their tools.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ...bounds import INTEGER_AT_LEAST_1
from ...options import option, options_record
from ..engines.base import Continuation, SamplingOptions, hashed_seed
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
    # partial rollouts (generation/rounds.py): a trajectory carried over between rounds
    ver: list[int] = field(default_factory=list)  # the policy version that sampled (or appended) each token
    turn_start: int = 0  # where its current turn starts in `ids` (tokens after it: a turn a round stopped)
    awaiting: Optional[list] = None  # the calls of its last turn whose results are not in yet ([]: malformed)
    environment: Optional[object] = None  # its environment instance (environment_factory), reset with its row
    reset_failed: bool = False  # its environment's reset raised: nothing is sampled (`AgentLoop.end_failed`)

    COUNTERS = ("turns", "rounds", "calls", "failures", "malformed", "truncated")
    LIVE = ("pending", "tools", "environment")  # handles on running calls and user objects: shared by copies

    @property
    def running_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def finish(self) -> Optional[str]:
        """None while it runs (a partial-rollout group's member), else how its last turn ended."""
        return self.finish_reason if self.done else None

    def __deepcopy__(self, memo) -> "Trajectory":
        """A copy of its tokens and records sharing its live handles (the trainer copies its state at each
        round's start, to rewind to on an interrupt: running calls and environments are not copied)."""
        import copy

        out = copy.copy(self)
        for name, value in vars(self).items():
            if name not in self.LIVE:
                setattr(out, name, copy.deepcopy(value, memo))
        return out

    def to_dict(self) -> dict:
        """The checkpoint's form (a partial-rollout member): tokens, log-probs (NaN as None), mask, versions,
        messages, counters, the calls awaiting results (run again on resume: their threads are not saved)."""
        return {"prompt_ids": self.prompt_ids, "seed": self.seed, "ids": self.ids, "mask": self.mask, "ver": self.ver,
                "logp": [None if math.isnan(x) else x for x in self.logp], "messages": self.messages,
                "finish": self.finish, "finish_reason": self.finish_reason, "turn_start": self.turn_start,
                "awaiting": self.awaiting, "reset_failed": self.reset_failed,
                **{k: getattr(self, k) for k in self.COUNTERS}}

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        return cls(prompt_ids=list(d["prompt_ids"]), seed=int(d["seed"]), ids=list(d["ids"]), mask=list(d["mask"]),
                   logp=[math.nan if x is None else float(x) for x in d["logp"]], ver=list(d["ver"]),
                   messages=list(d["messages"]), finish_reason=d["finish_reason"], done=d["finish"] is not None,
                   turn_start=int(d["turn_start"]), awaiting=d["awaiting"], reset_failed=bool(d.get("reset_failed")),
                   **{k: int(d[k]) for k in cls.COUNTERS})


@options_record
@dataclass(frozen=True)
class LoopOptions:
    """The turn loop's limits: the completion budget and the sampling of this call (the caller's), and the
    tool limits of the run."""

    max_completion_length: int
    sampling: SamplingOptions
    max_tool_calling_iterations: Optional[int] = option(None, "multi_turn: most rounds of tool calls per trajectory (TRL's); a turn with calls past it ends the trajectory. None: no limit but max_completion_length.", bounds=INTEGER_AT_LEAST_1)
    max_tool_response_tokens: int = option(256, "multi_turn: most tokens of one tool result; a longer one is cut (counted in tools/truncated_frequency). Tool results count toward max_completion_length.", bounds=INTEGER_AT_LEAST_1)


class AgentLoop:
    def __init__(self, engine, tokenizer, chat: ChatTemplate, runner: ToolRunner, options: LoopOptions):
        self.engine, self.tokenizer, self.chat, self.runner, self.o = engine, tokenizer, chat, runner, options
        self.waiting_seconds = 0.0  # tool time no decoding overlapped (the whole loop's)
        self.version = 0  # the policy version sampling now (partial rollouts: recorded per token)

    # ---- one turn's bookkeeping ----------------------------------------------------------------

    def budget(self, t: Trajectory) -> int:
        """Tokens the next turn may add: the completion budget and the engine's context, whichever is less."""
        return min(self.o.max_completion_length - len(t.ids), self.engine.max_model_len - len(t.running_ids))

    def request(self, t: Trajectory) -> Continuation:
        """Its next turn as a request: a new turn, or the rest of one a round stopped (seeded by where it goes on)."""
        into = len(t.ids) - t.turn_start
        seed = hashed_seed(t.seed, t.turns, into) if into else hashed_seed(t.seed, t.turns)
        return Continuation(prompt_ids=t.running_ids, max_new_tokens=self.budget(t), seed=seed)

    def _append(self, t: Trajectory, token_ids: list[int], logprobs: list[float], sampled: bool) -> None:
        t.ids += token_ids
        t.logp += [float(x) for x in logprobs] if sampled else [math.nan] * len(token_ids)
        t.mask += [sampled] * len(token_ids)
        t.ver += [self.version] * len(token_ids)

    def carry(self, t: Trajectory, token_ids: list[int], logprobs: list[float]) -> None:
        """What a turn sampled before its round stopped (the turn goes on in the next round; stopped on its
        last token, it ends there, by length)."""
        self._append(t, token_ids, logprobs, True)
        if self.budget(t) < 1:
            self._turn_done(t, [], [], "length")

    def _turn_done(self, t: Trajectory, token_ids: list[int], logprobs: list[float], finish_reason: str) -> None:
        """Append a sampled turn (or its last part); start its calls, or end the trajectory."""
        self._append(t, token_ids, logprobs, True)
        turn, prefix = t.ids[t.turn_start:], t.prompt_ids + t.ids[: t.turn_start]
        t.turns += 1
        t.turn_ends.append(time.monotonic())
        t.finish_reason = finish_reason
        if finish_reason == "stop":
            content, calls, malformed = self.chat.parse(turn, prefix)
        else:  # (cut by the budget: no call runs)
            content, calls, malformed = self.tokenizer.decode(turn, skip_special_tokens=True), [], False
        t.messages.append({"role": "assistant", "content": content,
                           **({"tool_calls": [{"type": "function", "function": c} for c in calls]} if calls else {})})
        limit = self.o.max_tool_calling_iterations
        if finish_reason != "stop" or not (calls or malformed) or (limit is not None and t.rounds >= limit) \
                or self.budget(t) < 1:
            t.done = True
            return
        t.malformed += malformed
        t.calls += len(calls)
        t.awaiting = list(calls)
        self.start_calls(t)

    def end_failed(self, t: Trajectory) -> None:
        """A trajectory whose environment failed to reset ends before its first turn: one masked end-of-turn token
        (a completion is never empty), an empty answer; nothing of it trains."""
        self._append(t, [self.chat.end_of_turn], [], False)
        t.messages.append({"role": "assistant", "content": ""})
        t.finish_reason, t.done = "stop", True

    def start_calls(self, t: Trajectory) -> None:
        """Run the calls its last turn made (again, after a resume: their threads are not in a checkpoint)."""
        t.pending = self.runner.start(t.awaiting, t.tools) if t.awaiting else None

    def ready(self, t: Trajectory) -> bool:
        """Whether the results it awaits are in (or timed out)."""
        return t.pending is None or t.pending.ready()

    def results_in(self, t: Trajectory) -> bool:
        """The finished calls' results appended (masked); whether it goes on (its next turn: `request(t)`)."""
        if t.pending is None:  # a malformed turn: one error result (counted as malformed, not as a failed call)
            messages, failed = [{"role": "tool", "name": "invalid_call", "content": MALFORMED}], [False]
        else:
            pairs = [self._tool_message(t, r) for r in t.pending.results(self.runner.timeout)]
            messages, failed = [m for m, _ in pairs], [f for _, f in pairs]
        t.pending, t.awaiting = None, None
        t.rounds += 1
        try:
            between = self.chat.between_turns(messages)
        except Exception as err:  # noqa: BLE001 (the template cannot render what came back: each an error result)
            text = f"error: the result could not be rendered by the chat template ({type(err).__name__})"
            messages = [dict(m, content=text) for m in messages]
            failed = [True] * len(messages)
            try:
                between = self.chat.between_turns(messages)
            except Exception:  # noqa: BLE001 (not even an error result renders: the trajectory ends here)
                t.failures += sum(failed)
                t.done = True
                return False
        t.failures += sum(failed)
        if len(t.ids) + len(between) >= self.o.max_completion_length \
                or len(t.running_ids) + len(between) >= self.engine.max_model_len:
            t.done = True  # (rolled back: the results would leave no room for a turn)
            return False
        self._append(t, between, [], False)
        t.messages += messages
        t.turn_start = len(t.ids)
        return True

    def replay(self, messages: list[dict], tools: Optional[dict]) -> bool:
        """Run a trajectory's recorded calls again, in order, on `tools` (a fresh environment's): whether each
        gives the recorded result (as the trajectory holds it, cut to max_tool_response_tokens). A last turn's
        calls without results yet are left to the round (they await results, and run again there)."""
        scratch = Trajectory(prompt_ids=[], seed=0)
        for k, message in enumerate(messages):
            calls = [c["function"] for c in message.get("tool_calls") or []] if message["role"] == "assistant" else []
            recorded = [m["content"] for m in messages[k + 1 : k + 1 + len(calls)] if m["role"] == "tool"]
            if not calls or len(recorded) < len(calls):
                continue
            running = self.runner.start(calls, tools)
            running.wait()
            if [self._tool_message(scratch, r)[0]["content"] for r in running.results(self.runner.timeout)] != recorded:
                return False
        return True

    def _tool_message(self, t: Trajectory, r) -> tuple[dict, bool]:
        """(the tool message of result `r`, whether the call failed): its content cut to max_tool_response_tokens
        (counted in t.truncated); a name the model made up is shown as invalid_call (its text is the model's)."""
        name = r.name if r.name in (self.runner.tools if t.tools is None else t.tools) else "invalid_call"
        try:
            content, cut = self.chat.cut(r.content, self.o.max_tool_response_tokens)
        except Exception as err:  # noqa: BLE001 (a text the tokenizer does not take: the call's failure)
            return {"role": "tool", "name": name,
                    "content": f"error: the result of {name!r} could not be tokenized ({type(err).__name__})"}, True
        t.truncated += cut
        return {"role": "tool", "name": name, "content": content}, r.failed

    # ---- drivers -------------------------------------------------------------------------------

    def run(self, trajectories: list[Trajectory], lockstep: bool = False) -> list[Trajectory]:
        """Run the trajectories to their ends. lockstep: turns in lock-step even on an engine with a request loop
        (benchmarks/bench_agents.py compares the two)."""
        if getattr(self.engine, "runs_partial_rollouts", False) and not lockstep:
            self.stream(trajectories)
        else:
            self._run_lockstep(trajectories)
        return trajectories

    def _run_lockstep(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            if t.reset_failed and not t.done:
                self.end_failed(t)
        requests = {i: self.request(t) for i, t in enumerate(trajectories) if not t.done}
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
                if not t.done and self.results_in(t):
                    requests[i] = self.request(t)

    def stream(self, trajectories: list[Trajectory], enough: Callable[[], bool] = lambda: False,
               more: Callable[[int], list[Trajectory]] = lambda busy: [],
               on_done: Callable[[Trajectory, int], None] = lambda t, step: None) -> dict:
        """Run the trajectories' turns in the engine's request loop (`generate_until`), a trajectory's next turn
        joining the running batch as soon as its calls return, until every trajectory ended or `enough()` (asked
        after every engine step: partial rollouts' round end; a turn still running then keeps its tokens so far,
        a call still running goes on). more(busy): trajectories to start now (busy: the requests running);
        on_done(t, step): t ended at that engine step. Returns the engine steps, the requests running summed
        over them, the tokens sampled."""
        waiting, owners = [], []  # trajectories whose calls run; the trajectory of each request of the engine call
        counts = {"steps": 0, "busy": 0, "generated": 0}

        def start(new: list[Trajectory]) -> list[Continuation]:
            out = []
            for t in new:
                if t.reset_failed and not t.done:
                    self.end_failed(t)
                    on_done(t, counts["steps"])
                if t.done:
                    continue
                if t.awaiting is not None:  # (carried over with its calls running, or resumed: they run again)
                    if t.pending is None and t.awaiting:
                        self.start_calls(t)
                    waiting.append(t)
                    continue
                owners.append(t)
                out.append(self.request(t))
            return out

        def ready() -> list[Continuation]:
            """The next turns of the trajectories whose calls returned."""
            out = []
            for t in [t for t in waiting if self.ready(t)]:
                waiting.remove(t)
                if self.results_in(t):
                    owners.append(t)
                    out.append(self.request(t))
                else:
                    on_done(t, counts["steps"])
            return out

        def step_done(finished: list[bool]) -> bool:
            counts["steps"] += 1
            counts["busy"] += finished.count(False)
            return enough()

        def finished(k: int, c) -> None:
            t = owners[k]
            counts["generated"] += len(c.token_ids)
            self._turn_done(t, c.token_ids, c.logprobs, c.finish_reason)
            if t.done:
                on_done(t, counts["steps"])
            else:
                waiting.append(t)

        requests = start(trajectories)
        requests += start(more(len(requests)))
        while True:
            if requests:
                result = self.engine.generate_until(requests, step_done, more=lambda f: ready() + start(more(f.count(False))),
                                                    sampling=self.o.sampling, on_finished=finished)
                for t, c in zip(owners, result.completions, strict=True):
                    if c.finish_reason is None:  # stopped with the round: the turn goes on in the next one
                        counts["generated"] += len(c.token_ids)
                        self.carry(t, c.token_ids, c.logprobs)
                owners.clear()
            if not waiting or enough():
                return counts
            started = time.monotonic()  # every live trajectory waits on a tool: the only wait
            requests = ready()
            while not requests and waiting:
                time.sleep(0.001)
                requests = ready()
            self.waiting_seconds += time.monotonic() - started
            requests += start(more(len(requests)))

"""Agents: the model calls tools over several turns, and only the outcome is rewarded (rollout_mode
`multi_turn`, switched on by `GRPOTrainer(tools=...)` or `--tools`).

- `tools.py`: tools checked (`as_tools`: type hints, an `Args:` docstring, unique names) and run
  concurrently, each bounded by `tool_timeout` (`ToolRunner`), at most `max_tool_calls_per_turn` a turn;
- `isolation.py`: a result as text (cut where the tool ran), and tools in worker processes
  (`tool_isolation='process'`: a crash costs one call);
- `builtin.py`: the built-in tools by name (`calculator`) and `--tools` entries resolved;
- `chat.py`: the chat template that shows the tools (grpo_fast's ChatML one where the model has none),
  the calls parsed with `tokenizer.parse_response`, the token ids between turns;
- `loop.py`: the trajectories, token-exact, with the engine never waiting for a tool (vLLM).

`Agent` is what the trainer builds once (`build_agent`, from the run's `AgentOptions`) and the generate and
evaluate stages use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ...bounds import INTEGER_AT_LEAST_1, Bounds
from ...options import mirror, option, options_record
from .tools import ISOLATIONS, Tool, as_tools  # noqa: F401 (the public names)

TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency", "tools/malformed_frequency",
                "tools/truncated_frequency", "tools/turns_mean", "tools/time_waiting", "tools/reset_failure_frequency")
# the counters `Agent.rollouts` leaves in its Rollouts' stats (what TOOL_METRICS are computed from)
TOOL_COUNTERS = ("tools/calls", "tools/failures", "tools/malformed", "tools/truncated", "tools/turns",
                 "tools/trajectories", "tools/waiting_seconds", "tools/reset_failures")


@options_record
@dataclass(frozen=True)
class AgentOptions:
    """What building the run's Agent reads (`refuse_after`: the caller's, a generation batch's trajectories: that
    many failed environment resets in a row refuse the run; None: environments.py's default)."""

    tool_timeout: float = option(30.0, "multi_turn: seconds one tool call may take; past it the call is abandoned into "
                                 "an error result (counted in tools/failure_frequency) and the trajectory goes on.",
                                 bounds=Bounds(low=0, low_open=True, text="seconds > 0"))
    max_tool_calls_per_turn: int = option(16, "multi_turn: most tool calls run from one assistant turn (TRL has no cap); "
                                          "the calls past it do not run and are answered with an error result each, "
                                          "counted in tools/failure_frequency. 16 is well above the parallel calls chat "
                                          "models make in a turn, and bounds the threads (or workers) one turn starts.",
                                          bounds=INTEGER_AT_LEAST_1)
    tool_isolation: str = option("thread", "multi_turn: where tools run. thread: in the training process (fast; a tool "
                                 "that crashes natively or calls os._exit ends the run, which then never exits 0). "
                                 "process: each call in a worker process (about 50 ms to start one, reused; a crash, "
                                 "os._exit or a timeout costs that call, counted in tools/failure_frequency, and the "
                                 "worker is replaced). Tools must then be module-level functions; environment_factory "
                                 "runs in-process only.", ISOLATIONS)
    chat_template_path: Optional[str] = option(None, "multi_turn: a Jinja chat template file to train with (one that "
                                               "renders `tools` and is prefix-preserving: an earlier message renders the "
                                               "same whatever follows). None: the tokenizer's own if it renders tools, "
                                               "else for ChatML models (SmolLM2) grpo_fast's tool template.")
    chat_template_kwargs: Optional[dict] = option(None, "Extra keyword arguments for the chat template (TRL's; JSON on "
                                                  "the command line, e.g. '{\"enable_thinking\": false}').")
    max_tool_calling_iterations: Optional[int] = mirror(None)
    max_tool_response_tokens: int = mirror(256)
    prompt_column: str = mirror("prompt")
    refuse_after: Optional[int] = None


@dataclass(frozen=True)
class Agent:
    """The chat template, the tool runner (the run's tools) and the environments of a multi-turn run, its limits."""

    chat: object  # chat.ChatTemplate
    runner: object  # tools.ToolRunner
    max_tool_calling_iterations: Optional[int]
    max_tool_response_tokens: int
    environments: Optional[object] = None  # environments.Environments (environment_factory)
    prompt_column: str = "prompt"

    def loop(self, engine, tokenizer, *, sampling, max_completion_length: int):
        """The turn loop of one call (loop.py)."""
        from .loop import AgentLoop, LoopOptions

        return AgentLoop(engine, tokenizer, self.chat, self.runner, LoopOptions(
            max_completion_length=max_completion_length, max_tool_calling_iterations=self.max_tool_calling_iterations,
            max_tool_response_tokens=self.max_tool_response_tokens, sampling=sampling))

    def trajectory(self, prompt_ids: list[int], row: dict, seed: int):
        """A trajectory not started; with environments, its own instance reset with its row, the prompt
        extended by what reset returned."""
        from .chat import slot
        from .loop import Trajectory

        t = Trajectory(prompt_ids=list(prompt_ids), seed=seed)
        if self.environments is not None:
            h = self.environments.acquire(row)
            t.environment, t.tools, t.reset_failed = h.instance, h.tools, h.failed is not None
            observation = [h.observation] if h.observation else []  # (untrusted: its special strings stay text)
            t.prompt_ids = self.chat.render(self._messages(row, slot(0) if observation else None),
                                            generation_prompt=True, schemas=self.environments.schemas(h.name),
                                            untrusted=observation)
        return t

    def restore(self, t, row: dict, loop) -> bool:
        """A trajectory read back from a checkpoint made whole again: with environments, a fresh instance reset
        with its row and the recorded calls replayed on it (`loop.replay`). False where that does not give back
        the recorded prompt and results (the environment is not deterministic): t then starts again from its
        prompt, as a new trajectory with the same seed."""
        if self.environments is None or t.environment is not None:
            return True
        fresh = self.trajectory(t.prompt_ids, row, t.seed)
        if t.reset_failed and fresh.prompt_ids == t.prompt_ids:  # (failed before: stays failed, as it trained)
            self.environments.failed[id(fresh.environment)] = fresh.environment
            t.environment, t.tools = fresh.environment, fresh.tools
            return True
        if not fresh.reset_failed and fresh.prompt_ids == t.prompt_ids and loop.replay(t.messages, fresh.tools):
            t.environment, t.tools = fresh.environment, fresh.tools
            return True
        self.environments.release([fresh.environment])
        t.__dict__.update(self.trajectory(t.prompt_ids, row, t.seed).__dict__)  # (an instance reset, not replayed)
        return False

    def rollouts(self, engine, tokenizer, prompts: list[list[int]], rows: list[dict], seeds: Sequence[int], n: int,
                 *, sampling, max_completion_length: int):
        """n trajectories per prompt (prompt i's j-th seeded by hashed_seed(seeds[i], j)) as `Rollouts`, tool
        tokens masked out of the loss (NaN sampling log-probs), the tool counters in `stats`."""
        from ..engines.base import hashed_seed

        rows = [r for r in rows for _ in range(n)]  # (one per trajectory)
        if self.environments is not None:  # (the previous call's instances, scored by now, are free again; not
            self.environments.release(self.environments.last_call)  # those of trajectories in flight, if any)
        trajectories = [self.trajectory(prompts[i // n], rows[i], hashed_seed(seeds[i // n], i % n))
                        for i in range(len(rows))]
        if self.environments is not None:
            self.environments.last_call = [t.environment for t in trajectories]
        loop = self.loop(engine, tokenizer, sampling=sampling, max_completion_length=max_completion_length)
        loop.run(trajectories)
        return self.as_rollouts(trajectories, rows, tokenizer, loop.waiting_seconds)

    def as_rollouts(self, trajectories: list, rows: list[dict], tokenizer, waiting_seconds: float):
        """The trajectories as `Rollouts` (one row each), the tool counters in `stats`."""
        import torch

        from ..batch import Rollouts

        stats = {"tools/calls": sum(t.calls for t in trajectories), "tools/failures": sum(t.failures for t in trajectories),
                 "tools/malformed": sum(t.malformed for t in trajectories),
                 "tools/truncated": sum(t.truncated for t in trajectories),
                 "tools/turns": sum(t.turns for t in trajectories), "tools/trajectories": len(trajectories),
                 "tools/waiting_seconds": waiting_seconds,
                 "tools/reset_failures": sum(t.reset_failed for t in trajectories)}
        return Rollouts(
            prompt_ids=[t.prompt_ids for t in trajectories],
            completion_ids=[t.ids for t in trajectories],
            sampling_logp=[torch.tensor(t.logp, dtype=torch.float32) for t in trajectories],
            finish_reason=[t.finish_reason for t in trajectories],
            completion_texts=[tokenizer.decode(t.ids, skip_special_tokens=True) for t in trajectories],
            rows=rows,
            loss_mask=[torch.tensor(t.mask, dtype=torch.bool) for t in trajectories],
            kind=["trajectory"] * len(trajectories),
            stats=stats,
            messages=[t.messages for t in trajectories],
            environments=[t.environment for t in trajectories] if self.environments is not None else None,
        )

    def _messages(self, row: dict, observation: Optional[str]) -> list[dict]:
        """A row's prompt as messages, what its environment's reset returned appended to the last one (TRL's)."""
        prompt = row[self.prompt_column]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if observation:
            messages[-1]["content"] = messages[-1]["content"] + observation
        return messages


def tool_metrics(stats: dict, world=None) -> dict:
    """TRL's tools/* metrics from the counters of `Agent.rollouts` (empty where there were none). Under torchrun
    (`world`: every rank calls it) the counters are summed over the ranks first, so N ranks log the rates one
    process logs; time_waiting is the ranks' mean."""
    if "tools/trajectories" not in stats:
        return {}
    counted = {k: float(stats[k]) for k in TOOL_COUNTERS}
    if world is not None and world.size > 1:
        from ...distributed import sum_over_ranks

        counted = dict(zip(counted, sum_over_ranks(list(counted.values()), world), strict=True))
        counted["tools/waiting_seconds"] /= world.size
    n, calls = max(counted["tools/trajectories"], 1), counted["tools/calls"]
    turns_with_markup = calls + counted["tools/malformed"]
    return {"tools/call_frequency": calls / n,  # calls per trajectory (TRL)
            "tools/failure_frequency": counted["tools/failures"] / calls if calls else 0.0,  # failed per call (TRL)
            "tools/malformed_frequency": counted["tools/malformed"] / turns_with_markup if turns_with_markup else 0.0,
            "tools/truncated_frequency": counted["tools/truncated"] / calls if calls else 0.0,
            "tools/turns_mean": counted["tools/turns"] / n,
            "tools/time_waiting": counted["tools/waiting_seconds"],
            "tools/reset_failure_frequency": counted["tools/reset_failures"] / n}  # environments whose reset raised


def build_agent(tools: Sequence[Callable], tokenizer, options: AgentOptions, environments=None) -> Agent:
    """The run's Agent: the tools checked, the chat template chosen and checked (it renders the tools and is
    prefix-preserving; `options.chat_template_path` replaces the tokenizer's), before any work. environments:
    `environments.Environments` (environment_factory), built."""
    from .chat import ChatTemplate
    from .tools import ToolRunner

    checked = as_tools(list(tools))
    shown = checked if environments is None else [Tool(s["function"]["name"], None, s, False)
                                                  for s in next(iter(environments.schema_lists.values()))]
    if not shown:
        raise ValueError("tools: rollout_mode='multi_turn' needs at least one tool (tools=, --tools, or an environment "
                         "with public methods)")
    chat = ChatTemplate(tokenizer, shown, path=options.chat_template_path, kwargs=options.chat_template_kwargs)
    runner = ToolRunner(checked, options.tool_timeout, isolation=options.tool_isolation,
                        max_chars=chat.char_bound(options.max_tool_response_tokens),
                        max_calls=options.max_tool_calls_per_turn)
    if environments is not None and options.refuse_after is not None:  # (every reset of a generation batch failing:
        environments.refuse_after = options.refuse_after               # the class is broken, not a row)
    return Agent(chat=chat, runner=runner,
                 max_tool_calling_iterations=options.max_tool_calling_iterations,
                 max_tool_response_tokens=options.max_tool_response_tokens, environments=environments,
                 prompt_column=options.prompt_column)

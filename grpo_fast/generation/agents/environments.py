"""Environments (TRL's `environment_factory`): one instance per trajectory, pooled and reused once it is trained.

An environment is a class (or any callable returning an instance) with `reset(**row) -> str | None`: called
with the trajectory's dataset row before its first turn; a returned string extends the prompt's last message.
Every other public method is a tool of that trajectory (typed and documented like any tool); an optional
`get_reward() -> float` becomes a reward function named after the class, appended after the user's with
weight 1 (with no reward functions of the user's it is the first one, hence the verifier). Reward functions
receive `environments=[...]`, one instance per completion. A dict `{name: factory}` picks each row's
environment by its `environment` column.

Environment code is user code: it is built once at start (so a class without `reset`, or with a method the
model cannot be shown, is refused before any work); its tools run bounded like any tool. A reset that raises
fails that trajectory alone (TRL's would end the run): the trajectory samples nothing (loop.py's
`end_failed`), its environment's own reward is None (missing, as TRL reads None), and it is counted in
`tools/reset_failure_frequency`; the instance stays in the pool (its next reset is a fresh start). Only when
resets fail as many times in a row as a generation batch has trajectories (`refuse_after`: every one of a
batch) is the run refused, in one line naming the class. A reset that returns neither a string nor None is
a bug of the class, refused at once in one line naming the class and what was expected.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional, Union

from .tools import Tool, as_tool, as_tools

RESERVED = ("reset", "get_reward")


def environment_tools(instance) -> list[Tool]:
    """The tools of an environment instance: its public methods but reset and get_reward, bound."""
    names = [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if not name.startswith("_") and name not in RESERVED]
    return [as_tool(getattr(instance, name)) for name in names]


class Handed(NamedTuple):
    """An environment handed to one trajectory: the instance (reset with its row), its tools by name, the pool's
    name (None: a single factory) and what reset returned (a string extends the prompt)."""

    instance: object
    tools: dict
    name: Optional[str]
    observation: Optional[str]
    failed: Optional[str] = None  # why its reset failed ("TypeError: ..."); None: it was reset


class Environments:
    """The pools of a run's environments and the tools each shows (the run's own tools, then its methods)."""

    def __init__(self, factory: Union[Callable, dict], tools: list[Tool]):
        self.factories = dict(factory) if isinstance(factory, dict) else {None: factory}
        self.keyed = isinstance(factory, dict)
        self.standalone = list(tools)
        self.pools: dict = {}  # name -> every instance made
        self.free: dict = {}  # name -> the instances no trajectory holds
        self.lent: list = []  # (name, instance) held by a trajectory
        self.last_call: list = []  # the instances of the last synchronous call (`Agent.rollouts`), given back at the next
        self.schema_lists: dict = {}  # name -> the JSON schemas its trajectories' template shows
        self.reward_classes: list = []
        self.failed: dict = {}  # id -> instance whose last reset raised (its own reward is None until reset again)
        self.failures_in_a_row: dict = {}  # name -> its resets that raised since the last one that did not
        self.refuse_after = 64  # that many in a row refuse the run (build_agent: a generation batch's trajectories)
        for name, make in self.factories.items():
            label = getattr(make, "__name__", repr(make))
            if not callable(make):
                raise TypeError(f"environment_factory: {label!r} is not callable (a class or a function returning an "
                                f"environment)")
            instance = make()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"environment_factory: {type(instance).__name__} has no reset() method; an environment "
                                 f"needs reset(**row) -> str | None (called before each trajectory)")
            self.pools[name], self.free[name] = [instance], [instance]
            self.schema_lists[name] = [t.schema for t in as_tools([*self.standalone, *environment_tools(instance)])]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def schemas(self, name) -> list[dict]:
        return self.schema_lists[name]

    def acquire(self, row: dict) -> Handed:
        """An instance of the row's environment no trajectory holds (made where none is free), reset with the row."""
        name = row.get("environment") if self.keyed else None
        if name not in self.factories:
            raise ValueError(f"environment_factory: a row's environment {name!r} is not one of "
                             f"{sorted(map(str, self.factories))}")
        if self.free[name]:
            instance = self.free[name].pop(0)
        else:
            instance = self.factories[name]()
            self.pools[name].append(instance)
        self.lent.append((name, instance))
        label = type(instance).__name__
        tools = {t.name: t for t in [*self.standalone, *environment_tools(instance)]}
        try:
            observation = instance.reset(**({key: v for key, v in row.items() if key != "environment"} if self.keyed
                                            else dict(row)))
        except Exception as err:  # noqa: BLE001 (a failed trajectory, counted; not the run's end)
            why = _why(err)
            self.failed[id(instance)] = instance
            self.failures_in_a_row[name] = in_a_row = self.failures_in_a_row.get(name, 0) + 1
            if in_a_row >= self.refuse_after:
                raise RuntimeError(f"environment_factory: every reset of {label} failed ({in_a_row} in a row, a "
                                   f"generation batch's worth); the last raised {why}") from None
            return Handed(instance, tools, name, None, failed=why)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"environment_factory: {label}.reset returned {type(observation).__name__} "
                            f"{_short(observation)}; expected a str (appended to the prompt's last message) or None")
        self.failed.pop(id(instance), None)
        self.failures_in_a_row[name] = 0
        return Handed(instance, tools, name, observation)

    def release(self, instances: list) -> None:
        """Give these instances back (their trajectories were trained: scored, their rewards read; or dropped)."""
        back = {id(i) for i in instances}
        for name, instance in self.lent:
            if id(instance) in back:
                self.free[name].append(instance)
        self.lent = [(name, instance) for name, instance in self.lent if id(instance) not in back]

    def release_all_but(self, held: list) -> None:
        """Give back every instance lent but those `held` (by trajectories still in flight)."""
        keep = {id(i) for i in held}
        self.release([instance for _, instance in self.lent if id(instance) not in keep])

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class with get_reward, named after it (TRL's)."""
        funcs = []
        for cls in self.reward_classes:
            def reward(prompts=None, completions=None, environments=None, _cls=cls, **columns):
                return [e.get_reward() if type(e) is _cls and id(e) not in self.failed else None for e in environments]

            reward.__name__ = cls.__name__
            funcs.append(reward)
        return funcs


def _why(err: BaseException) -> str:
    """`err` on one line (its str() may raise, or hold lone surrogates that stderr cannot print)."""
    from .isolation import valid_text

    try:
        return valid_text(" ".join(f"{type(err).__name__}: {err}".split()))
    except Exception:  # noqa: BLE001
        return type(err).__name__


def _short(value) -> str:
    """repr(value), at most 60 characters (a repr that raises: nothing)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        return ""
    return text if len(text) <= 60 else text[:57] + "..."

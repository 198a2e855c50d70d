"""Options declared once: each stage's options record declares its fields (default, help, choices, bounds),
`GRPOConfig` is assembled from those declarations, and a stage is handed its record, not the whole config.

    @options_record
    @dataclass(frozen=True)
    class SamplingOptions:
        temperature: float = option(1.0, "Sampling temperature; ...", bounds=POSITIVE_FINITE)
        top_k: int = option(0, "...", config_name="top_k")
        n: int = 1                                   # not an option of the run: given by the caller

    @dataclass                                       # GRPOConfig's body names the field and its type only:
    @from_records                                    #   temperature: float
    class GRPOConfig: ...                            # the declaration (default, help, range) is the record's

    SamplingOptions.from_config(config, n=4)        # the record of a run's config (`from_config` below)

A record field's `config_name` is the config field it stands for (default: the same name; TRL's names stay the
config's: `epsilon` is LossOptions' `epsilon_low`). A config field is declared once: by one record (`option`),
or by `GRPOConfig`'s own body where no stage owns it; another record that reads it takes it with `mirror`
(filled by `from_config`, no help of its own). A field that is neither is the caller's (`from_config(config,
name=...)`). `tests/test_options.py` checks every registered record's defaults against the config's. This
module is light (dataclasses only): every layer may import it. Rules between fields are rows too
(`Combination`: config_checks' table, and a rollout mode's own `checks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from .bounds import Bounds

RECORDS: list = []  # every options record, in registration order (the defaults test walks them)


def option(default, help: str, choices=None, bounds: Optional[Bounds] = None, *, config_name: Optional[str] = None):
    """A dataclass field that is a run option: its default, its help text (the CLI's --help), its allowed values
    or numeric range, and the config field it mirrors (`config_name`, default the field's own name)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if bounds is not None:
        metadata["bounds"] = bounds
    if config_name is not None:
        metadata["config_name"] = config_name
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def mirror(default, *, config_name: Optional[str] = None):
    """A record field that reads a config field declared elsewhere (by another record, or by GRPOConfig's own
    body): `from_config` fills it; its default must equal the declaration's (tests/test_options.py)."""
    metadata = {"mirrors": config_name or True}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def declares(f: dataclasses.Field) -> bool:
    """Whether a record field is the declaration of a config field (an `option`: it has the help text)."""
    return "help" in f.metadata


def config_name(f: dataclasses.Field) -> Optional[str]:
    """The config field a record field declares or mirrors; None for a field the caller gives."""
    if declares(f):
        return f.metadata.get("config_name", f.name)
    mirrors = f.metadata.get("mirrors")
    return f.name if mirrors is True else mirrors


def read_config(record, config, **given):
    """The record of `config`: each option and mirror field from its config field; `given` sets the rest
    (fields the caller gives) or overrides."""
    values = {f.name: getattr(config, config_name(f)) for f in dataclasses.fields(record)
              if f.init and config_name(f) is not None and f.name not in given}
    return record(**values, **given)


def options_record(cls):
    """Register a record (a dataclass whose fields use `option` and `mirror`) and give it `from_config`
    (`read_config`), unless it defines its own (which may call `read_config`)."""
    if "from_config" not in cls.__dict__:
        cls.from_config = classmethod(read_config)
    RECORDS.append(cls)
    return cls


def declarations() -> dict:
    """config field name -> (the record, its field) for every registered record's option fields."""
    out: dict = {}
    for record in RECORDS:
        for f in dataclasses.fields(record):
            if not declares(f):
                continue
            name = config_name(f)
            if name in out and out[name][0] is not record:
                raise TypeError(f"config field {name!r} is declared by both {out[name][0].__name__} and "
                                f"{record.__name__}: declare it in one record, the other reads it with mirror()")
            out[name] = (record, f)
    return out


def from_records(cls):
    """Class decorator, applied before @dataclass (written below it): every annotated field of `cls` without a value takes its declaration
    (default or default_factory, help, choices, bounds) from the registered record that declares it."""
    known = declarations()
    cls.__option_records__ = {}  # config field name -> the record that declares it (tests/test_options.py)
    for name in cls.__dict__.get("__annotations__", {}):
        if name in cls.__dict__:
            continue
        if name not in known:
            raise TypeError(f"{cls.__name__}.{name} has no value and no options record declares it")
        record, f = known[name]
        cls.__option_records__[name] = record
        metadata = {k: v for k, v in f.metadata.items() if k != "config_name"}
        if f.default_factory is not dataclasses.MISSING:
            setattr(cls, name, dataclasses.field(default_factory=f.default_factory, metadata=metadata))
        else:
            setattr(cls, name, dataclasses.field(default=f.default, metadata=metadata))
    return cls


def default_of(record, name: str) -> Any:
    """A record field's default (its factory called)."""
    f = record.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ---- what combines with what: the rows of config_checks.COMBINATIONS (and of each rollout mode's `checks`) ----


@dataclasses.dataclass(frozen=True)
class Combination:
    """While `when(c)` holds, GRPOConfig.`field` must satisfy `ok(value)`; the refusal reads
    "GRPOConfig.<field>=<value> is invalid: expected <allowed> <because>" (one process), or
    "... is not supported under torchrun (WORLD_SIZE=N) yet: <because>; run it in one process" (`ranks`:
    a rule of many ranks, checked only there). allowed / because: text, or a function of the config."""

    field: str
    ok: Callable
    allowed: Union[str, Callable]
    when: Callable
    because: Union[str, Callable]
    ranks: bool = False

    def text(self, what, c) -> str:
        return what(c) if callable(what) else what


def first_reward(c):
    return c.reward_funcs[0] if c.reward_funcs else None


# first reward functions whose values leave [0, 1] (a wrong answer scores below 0)
OUTSIDE_01 = {"lead": "-1 for a wrong answer", "math_length": "down to -1 for a wrong answer"}

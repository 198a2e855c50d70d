"""Options declared once: each stage's options record declares its fields (default, help, choices, bounds),
`GRPOConfig` is assembled from those declarations, and a stage is handed its record, not the whole config.

    @options_record
    @dataclass(frozen=True)
    class SamplingOptions:
        temperature: float = option(1.0, "Sampling temperature; ...", bounds=POSITIVE_FINITE)
        top_k: int = option(0, "...", config_name="top_k")
        n: int = 1                                   # not an option of the run: given by the caller

    @from_records                                    # GRPOConfig's body names the field and its type only:
    @dataclass                                       #   temperature: float
    class GRPOConfig: ...                            # the declaration (default, help, range) is the record's

    SamplingOptions.from_config(config, n=4)        # the record of a run's config (`from_config` below)

A record field's `config_name` is the config field it mirrors (default: the same name; TRL's names stay the
config's: `epsilon` is LossOptions' `epsilon_low`). `tests/test_options.py` checks every registered record's
defaults against the config's. This module is light (dataclasses only): every layer may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

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


def config_name(f: dataclasses.Field) -> Optional[str]:
    """The config field a record field mirrors; None for a field that is not an option (no help)."""
    if "help" not in f.metadata:
        return None
    return f.metadata.get("config_name", f.name)


def options_record(cls):
    """Register a record (a dataclass whose option fields use `option`) and give it `from_config`."""

    def from_config(record, config, **given):
        """The record of `config`: each option field from the config field it mirrors; `given` sets the rest
        (fields that are not options) or overrides."""
        values = {f.name: getattr(config, config_name(f)) for f in dataclasses.fields(record)
                  if f.init and config_name(f) is not None and f.name not in given}
        return record(**values, **given)

    cls.from_config = classmethod(from_config)
    RECORDS.append(cls)
    return cls


def declarations() -> dict:
    """config field name -> (the record, its field) for every registered record's option fields."""
    out: dict = {}
    for record in RECORDS:
        for f in dataclasses.fields(record):
            name = config_name(f)
            if name is None:
                continue
            if name in out and out[name][0] is not record:
                raise TypeError(f"config field {name!r} is declared by both {out[name][0].__name__} and "
                                f"{record.__name__}: declare it in one record, the other mirrors it without help")
            out[name] = (record, f)
    return out


def from_records(cls):
    """Class decorator (before @dataclass): every annotated field of `cls` without a value takes its declaration
    (default or default_factory, help, choices, bounds) from the registered record that declares it."""
    known = declarations()
    for name in cls.__dict__.get("__annotations__", {}):
        if name in cls.__dict__:
            continue
        if name not in known:
            raise TypeError(f"{cls.__name__}.{name} has no value and no options record declares it")
        record, f = known[name]
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

"""Options are declared once: every options record's defaults are GRPOConfig's, every config field with help has
one declaration, and no record repeats a config default under a name of its own (grpo_fast/options.py)."""

import dataclasses

import grpo_fast.trainer  # noqa: F401 (every stage's records registered, those that only mirror fields too)
from grpo_fast import options
from grpo_fast.config import GRPOConfig

CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_record_defaults_are_the_configs():
    wrong = []
    for record in options.RECORDS:
        for f in dataclasses.fields(record):
            name = options.config_name(f)
            if name is None:
                continue
            assert name in CONFIG_FIELDS, f"{record.__name__}.{f.name} stands for {name!r}, which GRPOConfig lacks"
            if _default(f) != _default(CONFIG_FIELDS[name]):
                wrong.append(f"{record.__name__}.{f.name}={_default(f)!r}, GRPOConfig.{name}="
                             f"{_default(CONFIG_FIELDS[name])!r}")
    assert not wrong, wrong


def test_every_config_option_is_declared_once():
    declared = options.declarations()  # (two records declaring one field raise here)
    taken = GRPOConfig.__option_records__
    twice = [name for name in declared if name not in taken]  # a record's declaration, and one in config.py's body
    assert not twice, f"declared both by a record and in GRPOConfig's body: {twice}"
    assert all("help" in f.metadata for f in CONFIG_FIELDS.values())
    for name, (_record, f) in declared.items():
        assert CONFIG_FIELDS[name].metadata["help"] == f.metadata["help"], name


def test_records_do_not_repeat_a_config_default_under_their_own_name():
    """A record field the caller gives (no option, no mirror) must not copy the default of the config field it
    looks like (`<prefix>_<name>` or its own name): such a field is a second declaration; use option or mirror."""
    repeats = []
    for record in options.RECORDS:
        for f in dataclasses.fields(record):
            value = _default(f)
            if options.config_name(f) is not None or value is dataclasses.MISSING or value is None or \
                    isinstance(value, bool):
                continue
            for name, config_field in CONFIG_FIELDS.items():
                if (name == f.name or name.endswith("_" + f.name)) and _default(config_field) == value:
                    repeats.append(f"{record.__name__}.{f.name} repeats GRPOConfig.{name}={value!r}")
    assert not repeats, repeats


def test_from_config_reads_every_option_and_mirror():
    config = GRPOConfig(sandbox_timeout=3.5, epsilon=0.3, loss_backend="torch", scale_rewards="batch",
                        judge_model="default", judge_engine="hf", max_tool_response_tokens=100)
    for record, field, name in [("SandboxOptions", "timeout", "sandbox_timeout"), ("LossOptions", "epsilon_low", "epsilon"),
                                ("LossOptions", "backend", "loss_backend"),
                                ("AdvantageOptions", "scale_rewards", "scale_rewards"),
                                ("JudgeOptions", "engine", "judge_engine")]:
        (cls,) = [r for r in options.RECORDS if r.__name__ == record]
        assert getattr(cls.from_config(config), field) == getattr(config, name), (record, field)

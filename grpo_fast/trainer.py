"""`GRPOTrainer`: build once, then a short loop over named stages (docs/design.md, "The data path of one step").

    for each generation batch:
        generate     prompts -> engine -> completions + sampling log-probs     (time/generate)
        score        reward functions -> rewards [n, k]                        (time/reward)
        advantages   group-relative advantages [n]
        logprobs     [no grad] old / reference log-probs, IS weights           (time/logprob)
        train step   for μ iterations, for each optimizer step: packed micro-batches -> fused loss (time/train)
        sync         copy the new weights into the engine                      (time/weight_sync)

Everything that changes during training lives in `TrainState` (saved in checkpoints), so a resumed
run continues at the same step with the same data order and sampling seeds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from . import checkpoint, objective, resume, run_folder
from .config import GRPOConfig
from .loss_types import loss_type
from .metrics import Pooled
from .rewards.registry import reward_name
from .rollout.base import GREEDY, SamplingOptions, check_engine, prompt_seeds
from .train import distributed, partial_rollouts, rollout_modes, setup, shaping
from .train.forward import Packer, completion_logprobs
from .train.interrupt import Interrupted, StopRequests
from .train.rollouts import Rollouts, from_engine, importance_weights, score, zero_std_groups
from .train.step import LossOptions, train_step, trainable_tokens

logger = logging.getLogger(__name__)


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped `train()` after it wrote a checkpoint; the message says how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@dataclass
class TrainState:
    """Everything of the loop that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # passes over the training prompts started
    cursor: int = 0  # next position in this epoch's prompt order
    generation_calls: int = 0  # engine calls made (each gets seed + this, for reproducible sampling)
    skipped_steps: int = 0  # steps dropped for a non-finite loss or gradient
    signal_free_steps: int = 0  # steps in a row with no finite reward or a skipped update
    eval_history: list = field(default_factory=list)  # (step, accuracy)
    eval_reward_history: list = field(default_factory=list)  # (step, held-out mean of the first reward)
    eval_metric_history: dict = field(default_factory=dict)  # name -> [(step, value)] of the eval_metrics
    entropy_coef: Optional[float] = None  # the entropy bonus's coefficient now (adaptive: it moves); None: config's
    last_entropy: float = math.inf  # the bonus tokens' entropy at the last optimizer step (adaptive gate)
    global_batch: int = 0  # completions per optimizer step over all ranks (a resumed run must keep it)
    policy_version: int = 0  # weight syncs into the engine so far (partial rollouts: the version of each token)
    in_flight: list = field(default_factory=list)  # partial rollouts: the groups carried over (train/partial_rollouts.py)


class GRPOTrainer:
    """GRPO on a causal LM. See GRPOConfig for every option.

    reward_funcs: callables with TRL's signature `f(prompts, completions, completion_ids, **columns)
    -> list[float | None]`. train_dataset / eval_dataset: lists of dict rows (or HF datasets) with
    `config.prompt_column` and the columns the rewards read. model / tokenizer: a transformers causal
    LM and its tokenizer; None loads `config.model` (default: SmolLM2-135M-Instruct).
    engine: an already built rollout engine (None: built from `config.engine`).
    eval_metrics: held-out metrics besides the rewards, {name: function with the reward signature},
    each logged as `eval/<name>` (its mean, None counting as 0); the built-in tasks bring theirs.
    evaluate_only: for `evaluate()` alone (`grpo-fast eval`): output_dir is not checked.

    Checked before any work (model loading, engine start): the output folder (a fresh run never
    writes into an earlier run's folder; see `run_folder`), the checkpoint to resume, the rows, the
    columns the reward functions read, and prompt + completion lengths against the model's context.
    """

    def __init__(self, config: GRPOConfig, reward_funcs: Sequence[Callable], train_dataset, eval_dataset=None,
                 model=None, tokenizer=None, engine=None, eval_metrics: Optional[dict] = None, evaluate_only: bool = False):
        self.config = config
        self.world = distributed.join(config.distributed_strategy)  # under torchrun: this rank's place; one process: World()
        if self.world.size > 1:
            distributed.check_config(config)
        if engine is not None:  # an engine from elsewhere: the contract first, before any work
            check_engine(engine)
            if config.max_staleness:
                setup.check_partial_rollouts(engine, config)
        self.eval_metrics = dict(eval_metrics or {})
        self.resume_path = None if evaluate_only else run_folder.check_start(config)
        self.resume_overrides = [] if evaluate_only else self._check_resume()
        self.reward_funcs = setup.check_reward_funcs(reward_funcs, config)
        self.train_rows = setup.as_rows(train_dataset, config.prompt_column, "train_dataset")
        self.eval_rows = None if eval_dataset is None else setup.as_rows(eval_dataset, config.prompt_column, "eval_dataset")
        setup.check_reward_columns(self.reward_funcs, self.train_rows, "train_dataset")
        self.judge = setup.partial_credit_judge(config, self.train_rows)
        self.group_size = config.group_size  # entries per prompt in a generation batch
        torch.manual_seed(config.seed)
        self.model, self.tokenizer, self.model_path = setup.load_policy(config, model, tokenizer)
        setup.warn_emulated_bf16(config, self.model)
        self.train_prompt_ids = setup.encode(self.train_rows, self.tokenizer, config)
        setup.check_prompt_lengths(self.train_prompt_ids, config, self.model.config, "train_dataset")
        self.ref_model = setup.frozen_copy(self.model) if config.beta > 0 else None
        self.engine = engine if engine is not None else setup.build_engine(config, self.model, self.tokenizer, self.model_path)
        if config.max_staleness:  # (engine='auto' falls back to HF where vLLM is not installed)
            setup.check_partial_rollouts(self.engine, config)
        cuda = next(self.model.parameters()).is_cuda
        self.packer = Packer(self.model, config.token_budget(cuda=cuda), amp_dtype=setup.amp_dtype(config, cuda))
        self.loss_options = LossOptions.from_config(config)
        self.advantage_options = shaping.AdvantageOptions.from_config(config)
        self.sampling = SamplingOptions.from_config(config)  # every training engine call's (evaluation: GREEDY)
        # many ranks: DDP or FSDP2 (one process: the model as it is); the reference sharded alike
        self.parallel = distributed.parallelize(self.model, self.world, config.distributed_strategy)
        self.ref_parallel = None if self.ref_model is None else distributed.parallelize(
            self.ref_model, self.world, self.parallel.strategy, frozen=True)
        self.optimizer = setup.build_optimizer(self.model, config)
        self.scheduler = setup.build_scheduler(self.optimizer, config)
        self.state = TrainState(global_batch=config.completions_per_step * self.world.size)
        # the HF engine samples with the policy itself: its log-probs are the trainer's, no IS needed
        self.engine_shares_weights = self.engine.shares_weights_with(self.model)
        use_is = config.vllm_importance_sampling_correction
        if use_is is None:
            use_is = setup.default_is_correction(self.engine.dtype, self._trainer_precision(),
                                                 config.max_staleness)
        self.use_is = use_is and not self.engine_shares_weights
        if config.vllm_importance_sampling_correction and self.engine_shares_weights:
            warnings.warn("vllm_importance_sampling_correction=True has no effect with the HF engine: it samples with "
                          "the policy itself, so its log-probs are the trainer's (the correction stays off)",
                          stacklevel=2)
        # one update per generation batch: the old policy is the one being trained, so the step's own
        # forward gives the IS weights (train_step's importance_weights) and no old-policy pass runs
        on_policy = config.num_iterations == 1 and config.steps_per_generation == 1
        self.is_in_step = self.use_is and on_policy
        self.needs_old_logp = not on_policy
        self.metrics_logger = None
        self._saved_step = None  # the step of the last checkpoint this process wrote or resumed from

    @classmethod
    def from_config(cls, config: GRPOConfig, evaluate_only: bool = False) -> "GRPOTrainer":
        """Everything from the config: model, reward functions by name, the dataset or built-in task."""
        from .data.tasks import task_eval_metrics
        from .rewards import get_reward_funcs

        if not evaluate_only:
            run_folder.check_start(config)  # before the dataset is read
        train_rows, eval_rows = setup.datasets_from_config(config)
        funcs = get_reward_funcs(list(config.reward_funcs), max_completion_length=config.max_completion_length,
                                 lead_alpha=config.lead_alpha, lead_wrong_reward=config.lead_wrong_reward,
                                 num_generations=config.num_generations * (  # lead: a prompt's graded completions
                                     config.answers_per_thought if config.rollout_mode == "multi_answer" else 1))
        eval_metrics = task_eval_metrics(config.task) if config.dataset is None else None
        return cls(config, funcs, train_rows, eval_rows, eval_metrics=eval_metrics, evaluate_only=evaluate_only)

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------

    def train(self) -> dict:
        """Train for config.max_steps optimizer steps; returns the last logged metrics.

        The output folder is locked meanwhile. On SIGINT/SIGTERM it writes a checkpoint and raises
        `TrainingInterrupted`; a failure while sampling or scoring writes one too (if there are
        steps to keep), then re-raises."""
        c = self.config
        main = self.world.main  # rank 0 owns the output folder
        distributed.barrier(self.world)  # every rank has checked the folder before rank 0 writes into it
        with run_folder.RunLock(c.output_dir) if main else contextlib.nullcontext(), StopRequests() as stop:
            if main:
                checkpoint.remove_stale_temp_folders(c.output_dir)
            if self.resume_path is not None:
                self._resume(self.resume_path)
                if self.state.step >= c.max_steps:
                    print(f"{self.resume_path} is at step {self.state.step} >= max_steps={c.max_steps}: nothing to "
                          f"train (raise --max_steps to train further)", flush=True)
                    return {}
            elif c.overwrite_output_dir and main:
                run_folder.clear_run_files(c.output_dir)
            if main:
                resume.write_run_config(c)  # what a resume reads when no checkpoint was written yet
            distributed.barrier(self.world)
            return self._train_loop(stop)

    def _train_loop(self, stop: StopRequests) -> dict:
        c = self.config
        self.metrics_logger = _metrics_logger(c.output_dir, self.state.step) if self.world.main else _OtherRankMetrics()
        bar = _progress(c, self.state.step, self.world.main)
        if self.world.main:
            bar.print(self.precision_summary())
        last = {}
        try:
            if c.eval_before_train and self.state.step == 0 and self.eval_rows is not None:
                last = self._log_eval(bar)
            deadline = None if c.max_train_minutes is None else time.perf_counter() + 60 * c.max_train_minutes
            while self.state.step < c.max_steps:
                # (every rank decides alike: a signal or the deadline on one rank stops them all)
                signalled, late = (distributed.any_rank(x, self.world) for x in
                                   (stop.signum is not None, deadline is not None and time.perf_counter() > deadline))
                if signalled:
                    stop.signum = stop.signum or signal.SIGTERM
                    break
                if late:
                    bar.print(f"max_train_minutes={c.max_train_minutes} reached after {self.state.step} steps: stopping")
                    break
                last = self._train_generation_batch(bar, stop) or last
        finally:
            bar.close()
        if stop.signum is not None:
            path = self._save()
            self.metrics_logger.close()
            raise TrainingInterrupted(
                f"{stop.name} at step {self.state.step}: checkpoint saved to {path}; continue with "
                f"`{self._resume_command()}` (resume_from_checkpoint='latest')", stop.signum)
        if self.eval_rows is not None and (not self.state.eval_history or self.state.eval_history[-1][0] != self.state.step):
            last = self._log_eval(bar)
        if c.save_final:
            self._save(os.path.join(c.output_dir, "final"), final=True)
        plot = self.metrics_logger.plot()
        if plot:
            bar.print(f"reward plot: {plot}")
        self.metrics_logger.close()
        return last

    def _train_generation_batch(self, bar, stop: StopRequests) -> dict:
        """One generation batch through every stage; returns the last logged metrics.

        Sampling and scoring change nothing but counters: a signal or an error there rewinds the
        state (counters and RNG) to the round's start, so a checkpoint written then resumes exactly."""
        c, times, first_step = self.config, {}, self.state.step
        start_state, start_rng = copy.deepcopy(self.state), checkpoint.rng_state()
        try:  # (many ranks: a round is never abandoned halfway, the next round's start agrees to stop)
            with stop.abandonable() if self.world.size == 1 else contextlib.nullcontext():
                batch, stats = self._generate_and_score(times)  # generate, score
                batch.advantages, adv_stats = shaping.advantages(  # advantages
                    batch, self.advantage_options, self.judge, prompt_column=c.prompt_column,
                    conversational=_conversational(batch.rows[0][c.prompt_column]), world=self.world)
                stats.update(adv_stats)
                with _timed(times, "time/logprob"):  # old / reference log-probs, IS weights
                    batch.old_logp, batch.ref_logp, batch.is_weights, side_stats = self._side_inputs(batch)
                stats.update(side_stats)
        except BaseException as err:
            self.state = start_state
            checkpoint.set_rng_state(start_rng)
            if isinstance(err, Interrupted):
                return {}  # train() saves and stops
            if isinstance(err, Exception) and self.state.step != (self._saved_step or 0) and self.world.size == 1:
                # (many ranks: the others wait in a collective; torchrun tears the job down, the last save stands)
                path = self._save()
                bar.print(f"{type(err).__name__} while sampling or scoring: progress saved to {path}")
            raise
        parts = self._step_slices(batch)
        # dapo: TRL's normaliser, the generation batch's tokens shared evenly by its step slices
        # (all ranks' tokens / ranks: DDP averages the ranks' gradients, TRL's normaliser under accelerate)
        tokens = distributed.sum_over_ranks([trainable_tokens(batch, self.loss_options)], self.world)[0] / self.world.size
        num_items = tokens / min(c.steps_per_generation, len(batch) // self.group_size)
        # the round's sampling figures (rollout/*: tokens generated, carried over, ...) count once: they go
        # with the first logged step of the round (as TRL logs a generation's figures once)
        once = {name: stats.pop(name) for name in list(stats) if name.startswith("rollout/")}
        logged = {}
        for k, part in enumerate(parts):  # train steps
            start = time.perf_counter()
            step_metrics = self._optimizer_step(part, num_items, bar)
            step_times = {name: t / len(parts) for name, t in times.items()}  # round costs, spread over its steps
            step_times["time/train"] = _sync_time(start)
            if k == len(parts) - 1:
                with _timed(step_times, "time/weight_sync"):
                    self._sync_weights()  # sync
                    self.state.policy_version += 1
                with _timed(step_times, "time/sync_check"):
                    step_metrics.update(self._check_engine_sync(part))
            logged = self._log(self._step_metrics(part, batch, step_metrics, {**stats, **once}, step_times), bar)
            if self._logs_step(self.state.step):
                once = {}
            if c.eval_steps and self.state.step % c.eval_steps == 0 and self.eval_rows is not None:
                logged = self._log_eval(bar) or logged
        if c.save_steps and self.state.step // c.save_steps > first_step // c.save_steps:
            self._save()  # at the round's end (a save_steps multiple was crossed): resumes exactly
        self._stop_without_signal(bar)
        return logged

    def _count_signal(self, part: Rollouts, skipped: bool, bar) -> None:
        """Count steps without a training signal: no finite reward at all, or a skipped update."""
        no_reward = not distributed.any_rank(not bool(part.rewards.isnan().all()), self.world)  # on no rank
        if not (no_reward or skipped):
            self.state.signal_free_steps = 0
            return
        self.state.signal_free_steps += 1
        why = ("every reward was None or non-finite: do the reward functions find the columns they read?"
               if no_reward else "the loss or gradient was non-finite and the update was skipped")
        bar.print(f"warning: step {self.state.step} had no training signal ({why}); "
                  f"{self.state.signal_free_steps} such step(s) in a row")

    def _stop_without_signal(self, bar) -> None:
        limit, count = self.config.max_signal_free_steps, self.state.signal_free_steps
        if limit and count >= limit:
            path = self._save() if self.state.step != (self._saved_step or 0) else None
            raise RuntimeError(f"no training signal for {count} steps in a row (max_signal_free_steps={limit}): "
                               f"stopping{f'; progress saved to {path}' if path else ''}. Check the reward functions "
                               f"and the dataset's columns, or lower the learning rate if the loss is non-finite")

    def _step_slices(self, batch: Rollouts) -> list[Rollouts]:
        """The optimizer steps a generation batch feeds: μ passes over steps_per_generation slices
        of whole groups, cut short at max_steps."""
        G = self.group_size
        slices = _split_groups(len(batch) // G, self.config.steps_per_generation)
        parts = [batch.select([g * G + j for g in groups for j in range(G)]) for groups in slices]
        return (parts * self.config.num_iterations)[: self.config.max_steps - self.state.step]

    def _optimizer_step(self, part: Rollouts, num_items: float, bar) -> dict:
        c, state = self.config, self.state
        coef = c.entropy_coef if state.entropy_coef is None else state.entropy_coef
        applied = objective.applied_entropy_coef(coef, state.last_entropy, adaptive=c.use_adaptive_entropy,
                                                 target=c.entropy_target)
        options = dataclasses.replace(self.loss_options, entropy_coef=applied)
        metrics = train_step(self.model, self.optimizer, self.packer, part, options, c.max_grad_norm,
                             num_items_in_batch=max(num_items, 1.0), top_entropy_quantile=c.top_entropy_quantile,
                             off_policy_mask_threshold=c.off_policy_mask_threshold, parallel=self.parallel,
                             importance_weights=self._is_weights if self.is_in_step else None)
        bonus_entropy = metrics.pop("bonus_entropy")
        if c.use_adaptive_entropy and not metrics["skipped"]:  # TRL's controller: the next step's coefficient and gate
            state.entropy_coef = objective.adaptive_entropy_coef(
                coef, bonus_entropy, target=c.entropy_target, delta=c.entropy_coef_delta, coef_min=c.entropy_coef_min,
                coef_max=c.entropy_coef_max)
            state.last_entropy = bonus_entropy
        if c.entropy_coef != 0.0 or c.use_adaptive_entropy:
            metrics["entropy_coef"] = coef if state.entropy_coef is None else state.entropy_coef
        else:
            metrics.pop("policy_loss")  # = loss without a bonus (TRL logs it only with one)
        with warnings.catch_warnings():  # a skipped step still advances the schedule
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.state.step += 1
        if metrics["skipped"]:
            self.state.skipped_steps += 1
            bar.print(f"step {self.state.step}: non-finite loss or gradient, step skipped (weights untouched)")
        self._count_signal(part, metrics["skipped"], bar)
        return metrics

    # ---- stages ------------------------------------------------------------------------------

    def _generate_and_score(self, times: dict) -> tuple[Rollouts, dict]:
        """Sample the generation batch and score it. With dynamic sampling (DAPO), groups whose
        rewards all agree are dropped and more prompts sampled, up to dynamic_sampling_max_rounds."""
        c, G = self.config, self.group_size
        wanted, kept, sampled_groups, zero_groups, rounds = c.prompts_per_generation, [], 0, 0, 0
        round_stats = dict.fromkeys(("rollout/carried_over", "rollout/staleness_mean", "rollout/staleness_max",
                                     "rollout/dropped_stale", "rollout/busy_fraction"), 0)  # synchronous: zeros
        generated = 0
        while True:
            with _timed(times, "time/generate"):
                if c.max_staleness:
                    part, round_stats = self._partial_round()
                else:
                    part = self._generate(*self._rank_share(self._next_prompts(
                        self.world.size * (wanted - sum(len(k) // G for k in kept)))))
                    generated += sum(len(ids) for ids in part.completion_ids)
                    round_stats["rollout/generated_tokens"] = generated
            with _timed(times, "time/reward"):
                part.rewards, non_finite = score(self.reward_funcs, part, c.prompt_column,
                                                 _conversational(part.rows[0][c.prompt_column]))
                part.stats["rewards_non_finite"] = non_finite
            zero = zero_std_groups(part.rewards, c.reward_weights, G)
            sampled_groups, zero_groups, rounds = sampled_groups + len(zero), zero_groups + int(zero.sum()), rounds + 1
            if not c.dynamic_sampling:
                kept = [part]
                break
            keep = [g * G + j for g in range(len(zero)) if not zero[g] for j in range(G)]
            if keep:
                kept.append(part.select(keep))
            if sum(len(k) for k in kept) >= wanted * G or rounds > c.dynamic_sampling_max_rounds:
                break
        batch = Rollouts.concat(kept) if kept else part  # nothing informative: train on the last round
        if len(batch) > wanted * G:
            batch = batch.select(range(wanted * G))
        stats = {"frac_reward_zero_std": zero_groups / max(sampled_groups, 1), "dynamic_sampling/rounds": rounds,
                 **round_stats}
        return batch, stats

    def _partial_round(self) -> tuple[Rollouts, dict]:
        """Partial rollouts: drop the too-stale groups, run a round (it draws new prompts as slots free up)."""
        c, state = self.config, self.state
        pool, dropped = partial_rollouts.drop_stale(state.in_flight, state.policy_version, c.max_staleness)

        def draw(n: int) -> list[dict]:  # n new groups: the next prompts of the data order, their seeds
            return partial_rollouts.new_groups(self._next_prompts(n), prompt_seeds(self._next_seed(), n),
                                               c.num_generations)

        if c.vllm_enable_sleep_mode:
            self.engine.wake()
        batch, state.in_flight, stats = partial_rollouts.run_round(
            self.engine, self.tokenizer, pool, draw, self.train_prompt_ids, self.train_rows, c, sampling=self.sampling,
            version=state.policy_version)
        if c.vllm_enable_sleep_mode:
            self.engine.sleep()
        stats["rollout/dropped_stale"] = dropped
        return batch, stats

    def _rank_share(self, prompt_index: list[int]) -> tuple[list[int], int]:
        """This rank's equal share of the generation batch's prompts (whole groups stay on one rank),
        and the position of its first prompt in the batch (which seeds it)."""
        k = len(prompt_index) // self.world.size
        return prompt_index[self.world.rank * k : (self.world.rank + 1) * k], self.world.rank * k

    def _generate(self, prompt_index: list[int], first: int = 0) -> Rollouts:
        c = self.config
        prompts, rows = [self.train_prompt_ids[i] for i in prompt_index], [self.train_rows[i] for i in prompt_index]
        if c.vllm_enable_sleep_mode:
            self.engine.wake()
        with self._engine_weights():
            batch = self._sample(prompts, rows, first)
        if c.vllm_enable_sleep_mode:  # free the engine's memory for the training passes (GPU)
            self.engine.sleep()
        return batch

    def _sample(self, prompts: list[list[int]], rows: list[dict], first: int) -> Rollouts:
        c = self.config
        if c.rollout_mode == "early_exit":
            batch = rollout_modes.early_exit(self.engine, self.tokenizer, prompts, rows, c, self._next_seed,
                                             sampling=self.sampling)
        elif c.rollout_mode == "multi_answer":
            batch = rollout_modes.multi_answer(self.engine, self.tokenizer, prompts, rows, c,
                                               setup.thought_end(c), self._next_seed, sampling=self.sampling)
        else:
            groups = self.engine.generate(prompts, n=c.num_generations, max_new_tokens=c.max_completion_length,
                                          sampling=self.sampling,
                                          seed=prompt_seeds(self._next_seed(), len(prompts), first))
            batch = from_engine(groups, prompts, rows)
        return batch

    def _engine_weights(self):
        """Where the engine samples with the policy itself (HF) under FSDP2: the whole model, gathered."""
        return self.parallel.gathered() if self.engine_shares_weights else contextlib.nullcontext()

    def _next_seed(self) -> int:
        """The sampling seed of the next engine call (each call its own; a resumed run continues the sequence)."""
        self.state.generation_calls += 1
        return _sampling_seed(self.config.seed, self.state.generation_calls)

    def _side_inputs(self, batch: Rollouts) -> tuple[Optional[list], Optional[list], Optional[list], dict]:
        """(old-policy log-probs, reference log-probs, IS weights, stats): each a list of `[C_i]`
        tensors or None when the run does not need it. No grad, no logits."""
        c, stats = self.config, {}
        compute = lambda m: completion_logprobs(m, self.packer, batch.prompt_ids, batch.completion_ids,
                                               temperature=c.temperature, backend=c.loss_backend)
        check = c.sampling_check_steps and self.state.step % c.sampling_check_steps == 0 and not self.is_in_step
        old_logp = is_weights = ref_logp = None
        if self.needs_old_logp or check:
            with self.parallel.gathered():  # FSDP2: one all-gather for the pass; ranks run their own micro-batches
                trainer_logp = compute(self.model)
            stats.update(_sampling_stats(trainer_logp, batch.sampling_logp))
            # on-policy, the loss takes old = lp.detach() itself: the diagnostic pass stays out of it
            old_logp = trainer_logp if self.needs_old_logp else None
        if self.use_is and not self.is_in_step:
            is_weights = [self._is_weights(o, s) for o, s in zip(old_logp, batch.sampling_logp, strict=True)]
            flat = torch.cat(is_weights) if is_weights else torch.zeros(0)
            if flat.numel():
                stats.update({"sampling/importance_sampling_ratio/min": flat.min().item(),
                              "sampling/importance_sampling_ratio/mean": Pooled.of(flat),
                              "sampling/importance_sampling_ratio/max": flat.max().item()})
        if self.ref_model is not None:
            with self.ref_parallel.gathered():
                ref_logp = compute(self.ref_model)
        return old_logp, ref_logp, is_weights, stats

    def _is_weights(self, trainer_logp: torch.Tensor, sampling_logp: torch.Tensor) -> torch.Tensor:
        """The IS weights of one completion (TRL's modes), from the trainer's and the sampler's log-probs."""
        c = self.config
        return importance_weights(trainer_logp, sampling_logp, mode=c.is_mode,
                                  cap=c.vllm_importance_sampling_cap, clip_min=c.vllm_importance_sampling_clip_min)

    def _sync_weights(self):
        if self.engine_shares_weights:
            return
        if self.config.vllm_enable_sleep_mode:
            self.engine.wake()
        # FSDP2: gathered layer by layer (every rank, in step); otherwise the live parameters
        self.engine.update_weights(self.parallel.full_weights() if self.parallel.sharded else self.model)

    def _check_engine_sync(self, part: Rollouts) -> dict:
        """The engine's log-probs of a short greedy probe against the trainer's, after a sync; one
        re-sync when they differ beyond the tolerance of their precisions, then an error."""
        from .train import sync_check

        if self.engine_shares_weights:
            return {}
        limit = sync_check.tolerance(self.engine.dtype, self._trainer_precision())
        probe = part.prompt_ids[0] + part.completion_ids[0]  # text the policy itself wrote: its ending is the probe
        gap = self._probe_gap(probe)
        if distributed.any_rank(gap > limit, self.world):  # (every rank re-syncs: under FSDP2 a sync is collective)
            logger.warning("engine log-probs differ from the trainer's by %.3g (> %.3g) after a weight sync: syncing again",
                           gap, limit)
            self._sync_weights()
            gap = self._probe_gap(probe)
            if distributed.any_rank(gap > limit, self.world):
                raise RuntimeError(f"the rollout engine is out of sync with the policy after step {self.state.step}: its "
                                   f"log-probs differ from the trainer's by {gap:.3g} on average (tolerance {limit:.3g} "
                                   f"for these precisions) even after a second weight sync; training on its samples "
                                   f"would train on a stale policy")
        return {"sampling/sync_check_diff": gap}

    def precision_summary(self) -> str:
        """One line: what the precision settings resolved to on this machine ("auto" depends on it)."""
        name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
        weights = next(self.model.parameters()).dtype
        engine = "shares the policy" if self.engine_shares_weights else name(self.engine.dtype)
        amp = f"{name(self.packer.amp_dtype)} autocast" if self.packer.amp_dtype else "no autocast"
        picked = " (vespo's token-level mode)" if self.config.vllm_importance_sampling_mode is None \
            and loss_type(self.config.loss_type).takes_is_ratio else ""
        is_mode = (f"on ({self.config.is_mode}{picked}{', from the step' if self.is_in_step else ''})"
                   if self.use_is else "off")
        return f"precision: weights {name(weights)}, decoder {amp}, engine {engine}, IS correction {is_mode}"

    def _trainer_precision(self) -> torch.dtype:
        """The dtype the trainer's log-probs are computed in: the decoder's autocast dtype, else the weights'."""
        return self.packer.amp_dtype or next(self.model.parameters()).dtype

    def _probe_gap(self, probe: list[int]) -> float:
        from .train import sync_check

        with self.parallel.gathered():
            return sync_check.probe_gap(self.engine, self.model, self.packer, probe, backend=self.config.loss_backend)

    def _next_prompts(self, k: int) -> list[int]:
        """The next k prompt indices in the seeded per-epoch order (wrapping into the next epoch)."""
        out, n = [], len(self.train_rows)
        while len(out) < k:
            order = _epoch_order(n, self.config.seed, self.state.epoch, self.config.shuffle_dataset)
            take = order[self.state.cursor : self.state.cursor + k - len(out)]
            out += take
            self.state.cursor += len(take)
            if self.state.cursor >= n:
                self.state.epoch, self.state.cursor = self.state.epoch + 1, 0
        return out

    # ---- evaluation --------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, rows: Optional[list] = None) -> dict:
        """Greedy completions for the held-out prompts (one each, whatever the rollout mode); accuracy =
        the share of correct answers: the first reward function's value > 0, whatever the shaping.
        Returns eval/accuracy, eval/reward, eval/rewards/<func>/mean, lengths (all, and of the right ones).
        Under torchrun every rank calls it: each grades every world-size-th prompt, the scores are gathered."""
        c = self.config
        rows = (rows if rows is not None else self.eval_rows or [])[: c.eval_max_samples]
        if not rows:
            raise ValueError("evaluate() needs eval rows: pass eval_dataset to GRPOTrainer or rows= to evaluate()")
        conversational = _conversational(rows[0][c.prompt_column])
        mine = rows[self.world.rank :: self.world.size]  # under torchrun each rank grades its share
        rewards = torch.empty(0, len(self.reward_funcs), dtype=torch.float64)
        lengths, extra = torch.empty(0), torch.empty(0, len(self.eval_metrics), dtype=torch.float64)
        prompt_ids = setup.encode(mine, self.tokenizer, c) if mine else []
        with self._engine_weights():  # (every rank enters, its share empty or not: under FSDP2 gathering is collective)
            groups = self.engine.generate(prompt_ids, n=1, sampling=GREEDY,
                                          max_new_tokens=c.eval_max_completion_length or c.max_completion_length) if mine else []
        if mine:
            batch = from_engine(groups, prompt_ids, mine)
            rewards, _ = score(self.reward_funcs, batch, c.prompt_column, conversational)
            lengths = batch.completion_lengths()
            if self.eval_metrics:  # the task's own grading (e.g. only answers in the instructed \boxed{})
                extra, _ = score(list(self.eval_metrics.values()), batch, c.prompt_column, conversational)
        rewards, lengths, extra = (distributed.gather_rows(t, self.world) for t in (rewards, lengths, extra))
        right = shaping.correct(rewards)
        out = {"eval/accuracy": right.float().mean().item(), "eval/reward": setup.weighted_mean(rewards, c.reward_weights),
               "eval/completions/mean_length": lengths.mean().item(),
               "eval/completions/mean_length_correct": lengths[right].mean().item() if right.any() else float("nan")}
        for j, f in enumerate(self.reward_funcs):
            out[f"eval/rewards/{reward_name(f)}/mean"] = _nanmean(rewards[:, j])
        for name, column in zip(self.eval_metrics, extra.T, strict=True):
            out[f"eval/{name}"] = torch.nan_to_num(column, nan=0.0).mean().item()
        return out

    def _log_eval(self, bar) -> dict:
        start = time.perf_counter()
        metrics = self.evaluate()
        metrics["time/eval"] = time.perf_counter() - start
        self.state.eval_history.append((self.state.step, metrics["eval/accuracy"]))
        first = f"eval/rewards/{reward_name(self.reward_funcs[0])}/mean"
        self.state.eval_reward_history.append((self.state.step, metrics[first]))
        for name in self.eval_metrics:
            self.state.eval_metric_history.setdefault(name, []).append((self.state.step, metrics[f"eval/{name}"]))
        extra = "".join(f", {name} {metrics[f'eval/{name}']:.3f}" for name in self.eval_metrics)
        bar.print(f"step {self.state.step}: held-out accuracy {metrics['eval/accuracy']:.3f}{extra} "
                  f"({min(len(self.eval_rows), self.config.eval_max_samples)} prompts, greedy, {metrics['time/eval']:.0f}s)")
        return self.metrics_logger.log(self.state.step, metrics)

    # ---- metrics, checkpoints ----------------------------------------------------------------

    def _step_metrics(self, part: Rollouts, batch: Rollouts, step_metrics: dict, stats: dict, times: dict) -> dict:
        m = setup.reward_metrics(part, self.reward_funcs, self.advantage_options)
        m.update(stats)
        m.update({k: v for k, v in step_metrics.items() if k != "skipped"})
        trained = trainable_tokens(part, self.loss_options)  # the loss's token means pool over ranks by tokens
        m.update({k: Pooled.weighted(m[k], trained) for k in objective.all_metric_names() if k != "policy_loss" and k in m})
        m.update(times)
        m["step_time"] = sum(v for k, v in m.items() if k.startswith("time/"))
        tokens = sum(len(p) + len(q) for p, q in zip(part.prompt_ids, part.completion_ids, strict=True))
        m["tokens_per_second"] = tokens / max(m["step_time"], 1e-9)
        m["learning_rate"] = self.scheduler.get_last_lr()[0]
        m["skipped_steps"] = self.state.skipped_steps
        m["rewards/non_finite"] = batch.stats.get("rewards_non_finite", 0)
        return m

    def _log(self, metrics: dict, bar) -> dict:
        metrics = distributed.reduce_metrics(metrics, self.world)
        step = self.state.step
        bar.update(step, metrics)
        if self._logs_step(step):
            return self.metrics_logger.log(step, metrics)
        return metrics

    def _logs_step(self, step: int) -> bool:
        """Whether optimizer step `step` writes a metrics line."""
        return step % self.config.logging_steps == 0 or step == self.config.max_steps

    def _save(self, path: Optional[str] = None, final: bool = False) -> str:
        """A checkpoint of the whole run (or, final=True, the trained model alone into `path`).
        Every rank calls it: each writes its shards, rank 0 the rest (checkpoint.py)."""
        c = self.config
        if final:
            return checkpoint.save_final_model(path, self.model, self.tokenizer, self.parallel)
        path = checkpoint.save_checkpoint(c.output_dir, self.state.step, model=self.model, tokenizer=self.tokenizer,
                                          optimizer=self.optimizer, scheduler=self.scheduler,
                                          state=dataclasses.asdict(self.state), config=c.to_dict(),
                                          total_limit=c.save_total_limit, parallel=self.parallel)
        self._saved_step = self.state.step
        return path

    def _check_resume(self) -> list[str]:
        """A resumed run keeps its saved options (resume.py): refused before any model loads; the overrides."""
        c = self.config
        if self.resume_path is None and c.resume_from_checkpoint is None:
            return []
        saved, in_flight = resume.saved_config(c.output_dir, self.resume_path)
        source = self.resume_path or os.path.join(c.output_dir, resume.RUN_CONFIG_FILE)
        return resume.check_resume(c, saved, source, in_flight)

    def _resume_command(self) -> str:
        """The command that continues this run: the output folder holds every other option."""
        ranks = f" --nproc_per_node {self.world.size}" if self.world.size > 1 else ""
        return f"grpo-fast train --output_dir {self.config.output_dir} --resume{ranks}"

    def _resume(self, path: str):
        saved = checkpoint.load_trainer_state(path)
        state = TrainState(**saved["state"])
        if state.global_batch and state.global_batch != self.state.global_batch:  # (0: saved before it was kept)
            raise ValueError(
                f"{path} was trained with {state.global_batch} completions per step over all ranks; this run has "
                f"per_device_train_batch_size x ranks x gradient_accumulation_steps = {self.config.per_device_train_batch_size}"
                f" x {self.world.size} x {self.config.gradient_accumulation_steps} = {self.state.global_batch}: set "
                f"per_device_train_batch_size or gradient_accumulation_steps to keep the global batch (the data order "
                f"and the next step depend on it)")
        state.global_batch = self.state.global_batch  # (a checkpoint from before it was kept: from now on)
        checkpoint.load_model_and_optimizer(path, saved, self.model, self.optimizer)  # any world size: resharded
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.resume_overrides:
            resume.apply_optimizer_overrides(self.optimizer, self.scheduler, self.config, self.resume_overrides)
            if "entropy_coef" in self.resume_overrides:
                state.entropy_coef = None  # the new coefficient, not the saved (possibly adapted) one
            logger.warning("%s", resume.describe_overrides(saved.get("config"), self.config, self.resume_overrides))
        self.state = state
        checkpoint.set_rng_state(checkpoint.rank_rng_state(saved, self.world.rank))
        self._sync_weights()
        self._saved_step = self.state.step
        logger.info("resumed from %s at step %d", path, self.state.step)


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


# Seeds derived from the run seed: seed * P + counter, with P a prime larger than any counter a run
# reaches, so two runs' seeds (seed s, counter k) and (s', k') never coincide unless s = s', k = k'
# (a plain seed + counter would give run 42's step 1 the seed of run 43's step 0).
_SAMPLING_SEED_PRIME = 100_003  # > the engine calls of any run
_EPOCH_SEED_PRIME = 1_000_003  # > the epochs of any run


def _sampling_seed(seed: int, generation_calls: int) -> int:
    return seed * _SAMPLING_SEED_PRIME + generation_calls


def _epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * _EPOCH_SEED_PRIME + epoch)).tolist()


def _split_groups(num_groups: int, parts: int) -> list[list[int]]:
    """Split group indices into `parts` contiguous, nearly equal, non-empty slices."""
    parts = max(1, min(parts, num_groups))
    bounds = [round(i * num_groups / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def _conversational(prompt) -> bool:
    return isinstance(prompt, list)


def _nanmean(x: torch.Tensor) -> float:
    known = x[~x.isnan()]
    return known.mean().item() if known.numel() else float("nan")


def _sampling_stats(old: list[torch.Tensor], sampling: list[torch.Tensor]) -> dict:
    diffs = [(o - s).abs() for o, s in zip(old, sampling, strict=True) if o.numel() and s.numel() == o.numel()]
    if not diffs:
        return {}
    flat = torch.nan_to_num(torch.cat(diffs), nan=0.0)
    return {"sampling/logp_diff_mean": Pooled.of(flat), "sampling/logp_diff_max": flat.max().item()}


def _sync_time(start: float) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


@contextlib.contextmanager
def _timed(times: dict, name: str):
    """Add the block's wall time to times[name]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + _sync_time(start)


def _metrics_logger(output_dir: str, step: int):
    from .metrics import MetricsLogger

    return MetricsLogger(output_dir, resume_step=step)


def _progress(config: GRPOConfig, step: int, main: bool = True):
    from .metrics import ProgressBar

    return ProgressBar(config.max_steps, step, enabled=main and not config.disable_tqdm, messages=main)


class _OtherRankMetrics:
    """The metrics logger of a rank other than 0: writes nothing (rank 0 writes the all-rank means)."""

    path = None

    def log(self, step: int, metrics: dict) -> dict:
        return metrics

    def plot(self):
        return None

    def close(self) -> None:
        pass


"""`GRPOTrainer`: build once, then a short loop over named stages (docs/design.md, "The data path of one step").

    for each generation batch:
        generate     prompts -> engine -> completions, scored; dynamic sampling   train/generate.py, score.py
        advantages   group-relative advantages [n], the variants' shaping         train/advantages.py
        logprobs     [no grad] old / reference log-probs, IS weights               train/logprobs.py
        train step   for μ iterations, for each optimizer step: packed micro-batches -> fused loss   train/step.py
        sync         copy the new weights into the engine, probe that they landed  train/sync.py
    evaluation and checkpoints between rounds                                      train/evaluate.py, checkpoint.py, resume.py

Each stage returns a record (`Generated`, `SideInputs`, a step's metrics); the loop makes the next batch
from it and logs the metrics. What changes during training lives in `TrainState` (train/state.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import config_checks, distributed
from .config import GRPOConfig
from .data import inputs
from .data.inputs import InputOptions
from .generation.engines import build as engine_build
from .generation.engines import may_read
from .generation.engines.base import SamplingOptions, asleep, check_engine
from .generation.modes import rollout_mode
from .loss_types import loss_type
from .models import moe, precision, routing
from .models.adapter import causal_lm_of, logit_transform
from .models.policy import (
    ContextBudget,
    Policy,
    PolicyOptions,
    check_prompt_lengths,
    prepare_policy,
    reference_copy,
    reference_of,
)
from .models.precision import Precision
from .objective import LossOptions
from .reporting import completions_table, trackers
from .reporting.metrics import logs_step, open_logger, progress, reduce_metrics, synced_time, timed
from .reporting.options import ReportOptions
from .run import checkpoint, resume
from .run import folder as run_folder
from .train import advantages, generate, kept_sets, logprobs, sequence_parallel, step, sync
from .train import evaluate as evaluation
from .train.advantages import AdvantageOptions
from .train.forward import Packer
from .train.interrupt import Interrupted, StopRequests, TrainingInterrupted
from .train.optimizer import OptimizerOptions, build_optimizer, build_scheduler
from .train.score import conversational
from .train.state import TrainState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    """The options each stage reads, built once from the config."""

    loss: LossOptions  # the train step's
    advantages: AdvantageOptions  # the advantages stage's
    sampling: SamplingOptions  # every training engine call's (evaluation: GREEDY)


class GRPOTrainer:
    """GRPO on a causal LM. See GRPOConfig for every option.

    reward_funcs: callables with TRL's signature `f(prompts, completions, completion_ids, **columns)
    -> list[float | None]`. train_dataset / eval_dataset: lists of dict rows (or HF datasets) with
    `config.prompt_column` and the columns the rewards read. model / tokenizer: a transformers causal
    LM and its tokenizer; None loads `config.model` (default: SmolLM2-135M-Instruct).
    engine: an already built rollout engine (None: built from `config.engine`). peft_config: a peft
    `LoraConfig` to train an adapter with (as TRL's; or `config.use_peft` and the lora_* fields). eval_metrics: held-out
    metrics besides the rewards, {name: function with the reward signature}, each logged as `eval/<name>`
    (its mean, None counting as 0). evaluate_only: for `evaluate()` alone: output_dir is not checked.

    Checked before any work (model loading, engine start): the output folder (`run_folder`), the checkpoint
    to resume, the rows, the columns the rewards read, prompt + completion lengths against the context.
    """

    def __init__(self, config: GRPOConfig, reward_funcs: Sequence[Callable], train_dataset, eval_dataset=None,
                 model=None, tokenizer=None, engine=None, eval_metrics: Optional[dict] = None, evaluate_only: bool = False,
                 peft_config=None, tools: Optional[Sequence[Callable]] = None, environment_factory=None):
        from .generation.agents import AgentOptions, build_agent
        from .generation.agents.parts import agent_parts, config_with_agents
        from .models import lora

        config = config_with_agents(config, tools, environment_factory)  # (tools switch on multi_turn)
        if peft_config is not None:  # TRL's way to ask for LoRA: the config then says use_peft and the adapter's shape
            config = dataclasses.replace(config, **lora.fields_of_peft_config(peft_config))
        elif model is not None and lora.is_lora(model):  # a PEFT model passed in (TRL takes one too): trained as it is
            config = dataclasses.replace(config, **lora.fields_of_model(model))
        elif lora.is_adapter_folder(config.model) and (config.use_peft or evaluate_only):
            # training an adapter folder (or evaluating a LoRA run's final/): the config takes the adapter's shape
            config = dataclasses.replace(config, **lora.fields_of_folder(config.model, config.lora_dropout))
        c = self.config = config
        self.world = distributed.join(c.distributed_strategy, c.sequence_parallel_size)  # under torchrun: this rank's place; one process: World()
        if self.world.size > 1:
            config_checks.check_ranks(c, os.environ.get("WORLD_SIZE"))  # what many ranks do not run yet
        if engine is not None:  # an engine from elsewhere: the contract first, before any work
            check_engine(engine)
            if c.max_staleness:
                engine_build.check_partial_rollouts(engine, c.max_staleness)
        if not evaluate_only:
            trackers.check_credentials(c.report_to)  # (before anything is loaded or written)
        self.resume_path = None if evaluate_only else run_folder.check_start(run_folder.RunFolderOptions.from_config(c))
        self.resume_overrides = [] if evaluate_only else resume.check_run(c, self.resume_path)
        mode, input_options = rollout_mode(c.rollout_mode), InputOptions.from_config(c)
        parts = agent_parts(tools, environment_factory, tool_names=c.tools, environment_name=c.environment_factory) \
            if mode.takes_agent else None  # (agents: tools checked, environments built)
        extra_rewards = parts[1].reward_functions() if parts and parts[1] is not None else ()
        reward_funcs, train_rows, eval_rows, judge = inputs.checked_inputs(
            input_options, reward_funcs, train_dataset, eval_dataset, inputs.reward_options(c, mode.graded_per_prompt(c)),
            extra_rewards)
        self.held_out = evaluation.HeldOut(rows=eval_rows, metrics=dict(eval_metrics or {}))
        torch.manual_seed(c.seed)
        precisions = Precision.from_config(c)
        budget = ContextBudget(c.max_prompt_length, c.max_sequence_completion, mode.sequence_text(c, longest=True),
                               c.eval_max_completion_length, c.vllm_max_model_length)
        model, tokenizer, model_path = prepare_policy(PolicyOptions.from_config(c), precisions, budget, c, model,
                                                      tokenizer, peft_config)
        moe.router_loss(causal_lm_of(model), c.router_aux_loss_coef)  # an MoE router loss we compute, or none asked for
        sequence_parallel.check_model(model, c.sequence_parallel_size, c.router_aux_loss_coef)  # (N > 1: heads, ...)
        routes = routing.RoutingOptions.from_config(c)
        if routes.records:  # routing replay: an MoE whose routing can be recorded and replayed
            routing.check_replayable(causal_lm_of(model))
        precision.warn_emulated_bf16(precisions, model, may_read(c.engine, "vllm_dtype"))
        agent = None if parts is None else build_agent(  # (renders the tools too)
            parts[0], tokenizer, AgentOptions.from_config(c, refuse_after=c.completions_per_step * c.steps_per_generation),
            parts[1])
        # (a dataset with images: encoded by the VLM's processor, each prompt's ImagePrompt for the engine)
        prompt_ids, prompt_images, train_rows = inputs.encode_with_images(train_rows, tokenizer, input_options, agent,
                                                                          model, model_path, eval_rows)
        check_prompt_lengths(prompt_ids, budget, model.config, "train_dataset")
        self.data = generate.TrainData(rows=train_rows, prompt_ids=prompt_ids, reward_funcs=reward_funcs, judge=judge,
                                       agent=agent, images=prompt_images)
        ref_model = reference_copy(model, c.beta)  # (before many ranks wrap the policy)
        self.engine = engine if engine is not None else engine_build.build_engine(
            engine_build.EngineOptions.from_config(c, lora_route=c.lora_route,
                                                   return_sampling_mask=SamplingOptions.from_config(c).truncates),
            precisions, model, tokenizer, model_path)
        if engine is not None and c.lora_route and not self.engine.shares_weights_with(model):
            engine_build.initial_sync(self.engine, model, c.lora_route)  # an engine passed in samples the adapted policy
        if c.max_staleness:  # (engine='auto' falls back to HF where vLLM is not installed)
            engine_build.check_partial_rollouts(self.engine, c.max_staleness)
        if routes.records:
            routing.check_engine(self.engine)
        cuda = next(model.parameters()).is_cuda
        packer = Packer(model, c.token_budget(cuda=cuda), amp_dtype=precisions.amp_dtype(cuda),
                        routing_replay=routes.routing_replay)
        packer.attention = sequence_parallel.packer_attention(model, c.sequence_parallel_size)  # (N = 1: None, as it was)
        loss_options = LossOptions.from_config(c, **logit_transform(causal_lm_of(model).config))  # (the model's map)
        self.options = Options(loss_options, AdvantageOptions.from_config(c), SamplingOptions.from_config(c))
        self.generation = generate.GenerateOptions.from_config(c)  # the generate stage's (the mode's, the rounds')
        # many ranks: DDP or FSDP2 (one process: the model as it is); the reference sharded alike
        parallel = distributed.parallelize(model, self.world, c.distributed_strategy)
        reference = reference_of(model, ref_model, self.world, parallel, c.beta)  # (LoRA: the policy, adapter off)
        self.policy = Policy(model, tokenizer, model_path, packer, parallel, reference, c.lora_route)
        optimizer_options = OptimizerOptions.from_config(c)
        self.optimizer = build_optimizer(model, optimizer_options)
        self.scheduler = build_scheduler(self.optimizer, optimizer_options)
        self.state = TrainState(global_batch=c.completions_per_step * self.world.size)
        is_options = logprobs.ISOptions.from_config(c, mode=c.is_mode)
        self.is_policy = logprobs.ISPolicy.resolve(is_options, self.engine, model, precision.trainer_dtype(packer, model))
        # truncated sampling: where each token's kept set comes from (returned by the engine, or rebuilt)
        self.kept_source = kept_sets.KeptSource.resolve(self.options.sampling, self.engine, rollout_mode(c.rollout_mode))
        self.metrics_logger = None
        self._saved_step = None  # the step of the last checkpoint this process wrote or resumed from

    # what callers read (the CLI, tests, benchmarks): views of the records above
    model = property(lambda self: self.policy.model)
    tokenizer = property(lambda self: self.policy.tokenizer)
    model_path = property(lambda self: self.policy.path)
    packer = property(lambda self: self.policy.packer)
    parallel = property(lambda self: self.policy.parallel)
    reward_funcs = property(lambda self: self.data.reward_funcs)
    train_prompt_ids = property(lambda self: self.data.prompt_ids)
    eval_rows = property(lambda self: self.held_out.rows)
    group_size = property(lambda self: self.config.group_size)  # entries per prompt in a generation batch
    # (read from the config when used: a caller may change its run control, max_steps say, between calls)
    report = property(lambda self: ReportOptions.from_config(self.config))
    engine_shares_weights = property(lambda self: self.is_policy.shares_weights)
    is_in_step = property(lambda self: self.is_policy.in_step)
    needs_old_logp = property(lambda self: self.is_policy.needs_old_logp)
    use_is = property(lambda s: s.is_policy.use_is, lambda s, on: setattr(s, "is_policy", s.is_policy.with_use_is(on)))

    @classmethod
    def from_config(cls, config: GRPOConfig, evaluate_only: bool = False) -> "GRPOTrainer":
        """Everything from the config: model, reward functions by name, the dataset or built-in task."""
        if not evaluate_only:
            trackers.check_credentials(config.report_to)  # a tracker's login too
            run_folder.check_start(run_folder.RunFolderOptions.from_config(config))  # before the dataset is read
        graded = rollout_mode(config.rollout_mode).graded_per_prompt(config)  # (what the lead reward compares)
        funcs, train_rows, eval_rows, eval_metrics = inputs.inputs_by_name(InputOptions.from_config(config),
                                                                           inputs.reward_options(config, graded))
        return cls(config, funcs, train_rows, eval_rows, eval_metrics=eval_metrics, evaluate_only=evaluate_only)

    def train(self) -> dict:
        """Train for config.max_steps optimizer steps; returns the last logged metrics. The output folder is
        locked meanwhile. On SIGINT/SIGTERM it writes a checkpoint and raises `TrainingInterrupted`; a failure
        while sampling or scoring writes one too (if there are steps to keep), then re-raises."""
        c = self.config
        main = self.world.main  # rank 0 owns the output folder
        distributed.barrier(self.world)  # every rank has checked the folder before rank 0 writes into it
        with run_folder.RunLock(c.output_dir) if main else contextlib.nullcontext(), StopRequests() as stop:
            if main:
                checkpoint.remove_stale_temp_folders(c.output_dir)
            if self.resume_path is not None:
                self._resume(self.resume_path)
                # (at max_steps, a run killed while writing final/ still has that to do: the loop below skips its
                # steps and writes it)
                folder = run_folder.RunFolderOptions.from_config(c)
                if self.state.step >= c.max_steps and not resume.unfinished(folder, self.state.step, self.policy.model):
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
        self.metrics_logger = open_logger(self.report, c.to_dict(), self.state, self.world.main)
        bar = progress(self.report, self.state.step, self.world.main)
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
                with contextlib.ExitStack() as training_passes:  # (sleep mode: the engine asleep in it, woken on the way out)
                    last = self._train_generation_batch(bar, stop, training_passes) or last
        finally:
            bar.close()
        if stop.signum is not None:
            path = self._save()
            self.metrics_logger.close()
            raise TrainingInterrupted(
                f"{stop.name} at step {self.state.step}: checkpoint saved to {path}; continue with "
                f"`{resume.resume_command(c.output_dir, self.world.size)}` (resume_from_checkpoint='latest')", stop.signum)
        if self.eval_rows is not None and (not self.state.eval_history or self.state.eval_history[-1][0] != self.state.step):
            last = self._log_eval(bar)
        if c.save_final:
            self._save(os.path.join(c.output_dir, "final"), final=True)
        plot = self.metrics_logger.plot()
        if plot:
            bar.print(f"reward plot: {plot}")
        self.metrics_logger.close()
        return last

    def _train_generation_batch(self, bar, stop: StopRequests, training_passes: contextlib.ExitStack) -> dict:
        """One generation batch through every stage; returns the last logged metrics.

        Sampling and scoring change nothing but counters: a signal or an error there rewinds the
        state (counters and RNG) to the round's start, so a checkpoint written then resumes exactly."""
        c, first_step, policy = self.config, self.state.step, self.policy
        start_state, start_rng = copy.deepcopy(self.state), checkpoint.rng_state()
        try:  # (many ranks: a round is never abandoned halfway, the next round's start agrees to stop)
            with stop.abandonable() if self.world.size == 1 else contextlib.nullcontext():
                generated = generate.generation_batch(self.engine, policy.tokenizer, self.data, self.state, self.generation,
                                                      self.options.sampling, self.world, self._engine_weights)  # generate, score
                batch, times = generated.batch, dict(generated.times)
                # sleep mode: the engine's memory is the training passes' until the weight sync wakes it
                training_passes.enter_context(asleep(self.engine, c.vllm_enable_sleep_mode))
                adv, adv_stats = advantages.advantages(  # advantages
                    batch, self.options.advantages, self.data.judge, prompt_column=c.prompt_column,
                    conversational=conversational(batch.rows[0][c.prompt_column]), world=self.world)
                batch = dataclasses.replace(batch, advantages=adv)
                with timed(times, "time/logprob"):  # old / reference log-probs, IS weights
                    side = logprobs.side_inputs(batch, policy, self.is_policy, temperature=c.temperature,
                                                backend=c.loss_backend, check=self.is_policy.checks(self.state.step, c.sampling_check_steps),
                                                kept_source=self.kept_source)
                batch = side.into(batch)
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
        stats = {**generated.metrics, **adv_stats, **side.metrics}
        steps = step.StepOptions.from_config(c, group_size=c.group_size)
        parts = step.step_slices(batch, steps, self.state.step)
        num_items = step.items_per_step(batch, steps, self.options.loss, self.world)  # dapo's normaliser
        # the round's sampling figures (rollout/*: tokens generated, carried over, ...) count once: they go
        # with the first logged step of the round (as TRL logs a generation's figures once)
        once = {name: stats.pop(name) for name in list(stats) if name.startswith("rollout/")}
        completions_table.log_completions(batch, step=self.state.step + 1, options=self.report,
                                          prompt_column=c.prompt_column, reward_funcs=self.data.reward_funcs,
                                          world=self.world, bar=bar, metrics_logger=self.metrics_logger)
        logged = {}
        for k, part in enumerate(parts):  # train steps
            start = time.perf_counter()
            step_metrics = self._optimizer_step(part, num_items, bar)
            step_times = {name: t / len(parts) for name, t in times.items()}  # round costs, spread over its steps
            step_times["time/train"] = synced_time(start)
            if k == len(parts) - 1:
                training_passes.close()  # (the engine awake again)
                with timed(step_times, "time/weight_sync"):
                    self._sync_weights()  # sync
                    self.state.policy_version += 1
                with timed(step_times, "time/sync_check"):
                    step_metrics.update(sync.check_engine_sync(
                        self.engine, policy, part, world=self.world, shares_weights=self.is_policy.shares_weights,
                        backend=c.loss_backend, step=self.state.step))
            logged = self._log(step.step_metrics(
                part, batch, step_metrics, {**stats, **once}, step_times, reward_funcs=self.data.reward_funcs,
                options=self.options, learning_rate=self.scheduler.get_last_lr()[0], state=self.state), bar)
            if logs_step(self.state.step, self.report):
                once = {}
            if c.eval_steps and self.state.step % c.eval_steps == 0 and self.eval_rows is not None:
                logged = self._log_eval(bar) or logged
        if c.save_steps and self.state.step // c.save_steps > first_step // c.save_steps:
            self._save()  # at the round's end (a save_steps multiple was crossed): resumes exactly
        step.stop_without_signal(self.state, c.max_signal_free_steps, self._save if self.state.step != (self._saved_step or 0) else None)
        return logged

    def _optimizer_step(self, part, num_items: float, bar) -> dict:
        c = self.config
        return step.optimizer_step(part, num_items, bar, self.policy, self.optimizer, self.scheduler,
                                   steps=step.StepOptions.from_config(c, group_size=c.group_size),
                                   options=self.options.loss, state=self.state, world=self.world,
                                   importance_weights=self.is_policy.weights if self.is_policy.in_step else None,
                                   kept_source=self.kept_source)

    def _engine_weights(self):
        """Where the engine samples with the policy itself (HF) under FSDP2: the whole model, gathered."""
        return self.policy.parallel.gathered() if self.is_policy.shares_weights else contextlib.nullcontext()

    def _sync_weights(self):
        sync.sync_weights(self.engine, self.policy, shares_weights=self.is_policy.shares_weights,
                          version=self.state.policy_version + 1)

    def precision_summary(self) -> str:
        """One line: what the precision settings resolved to on this machine ("auto" depends on it)."""
        c = self.config
        line = precision.precision_summary(
            self.policy.model, self.engine, self.policy.packer, self.is_policy, lora_route=c.lora_route,
            mode_picked=c.vllm_importance_sampling_mode is None and loss_type(c.loss_type).takes_is_ratio,
            lora_auto=c.lora_sync == "auto")
        if c.unsafe_code_execution:  # (the run's first line says it)
            line = "warning: --unsafe_code_execution: model-written code runs WITHOUT isolation (limits only)\n" + line
        if self.kept_source.active:  # (truncated sampling: where the kept sets come from)
            line += "\n" + self.kept_source.line()
            if self.kept_source.rebuilds and c.max_staleness:
                line += ("; stale tokens' sets are rebuilt from the current policy, not the one that sampled them "
                         "(an approximation: sampling/kept_set_misses counts the sampled tokens they left out)")
        return line

    def evaluate(self, rows: Optional[list] = None) -> dict:
        """Greedy held-out accuracy and rewards (train/evaluate.py); rows: the eval dataset's by default."""
        c = self.config
        return evaluation.evaluate(self.engine, self.policy.tokenizer, rows if rows is not None else self.eval_rows,
                                   self.data.reward_funcs, self.held_out.metrics, evaluation.EvalOptions.from_config(c),
                                   InputOptions.from_config(c), self.world, self._engine_weights, agent=self.data.agent)

    def _log_eval(self, bar) -> dict:
        start = time.perf_counter()
        metrics = self.evaluate()
        metrics["time/eval"] = time.perf_counter() - start
        bar.print(evaluation.record(self.state, metrics, self.data.reward_funcs, self.held_out.metrics,
                                    min(len(self.eval_rows), self.config.eval_max_samples)))
        return self.metrics_logger.log(self.state.step, metrics)

    def _log(self, metrics: dict, bar) -> dict:
        metrics = reduce_metrics(metrics, self.world)
        bar.update(self.state.step, metrics)
        return self.metrics_logger.log(self.state.step, metrics) if logs_step(self.state.step, self.report) else metrics

    def _save(self, path: Optional[str] = None, final: bool = False) -> str:
        """A checkpoint of the whole run (or, final=True, the trained model alone into `path`).
        Every rank calls it: each writes its shards, rank 0 the rest (checkpoint.py)."""
        c, p = self.config, self.policy
        if final:
            return checkpoint.save_final_model(path, p.model, p.tokenizer, p.parallel, merged=c.save_merged,
                                               step=self.state.step)
        path = checkpoint.save_checkpoint(c.output_dir, self.state.step, model=p.model, tokenizer=p.tokenizer,
                                          optimizer=self.optimizer, scheduler=self.scheduler, parallel=p.parallel,
                                          state=self.state.to_dict(), config=c.to_dict(), total_limit=c.save_total_limit)
        self._saved_step = self.state.step
        return path

    def _resume(self, path: str):
        self.state = resume.restore(path, TrainState, self.state, options=resume.ResumeOptions.from_config(self.config),
                                    world=self.world, model=self.policy.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                    overrides=self.resume_overrides)
        self._sync_weights()
        self._saved_step = self.state.step
        logger.info("resumed from %s at step %d", path, self.state.step)

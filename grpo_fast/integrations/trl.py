"""grpo_fast as an accelerated backend for TRL's `GRPOTrainer`.

    from grpo_fast.integrations.trl import FastGRPOTrainer      # same arguments as trl.GRPOTrainer
    trainer = FastGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

    trainer = accelerate(existing_trl_trainer)                  # or switch a built trainer over

Only the per-token log-prob passes (policy, old policy, reference) and the loss change: the decoder
runs to its final hidden states and grpo_fast's fused ops take them with the lm_head weight, so no
`[tokens x vocab]` logits tensor is ever materialised. Data, generation (transformers or vLLM),
rewards, advantages, logging and callbacks stay TRL's, and so do the logged metric names and values.

Supported: every loss_type of TRL 1.16 (grpo, bnpo, dr_grpo, dapo, cispo, sapo, vespo, luspo) with
their options, token and sequence importance sampling, beta with a reference model (or PEFT's
disabled adapter) and use_bias_correction_kl, num_iterations >= 1, epsilon / epsilon_high, delta
(when delta >= 1 + epsilon_high), vLLM importance-sampling correction (all modes),
top_entropy_quantile, off_policy_mask_threshold, the entropy bonus (entropy_coef,
use_adaptive_entropy: its gradient from the fused pass), tool masks, tied embeddings, lm_head bias,
cast_lm_head_to_fp32, use_liger_kernel (its layer kernels), gradient accumulation, DDP, and the MoE router
load-balancing loss (router_aux_loss_coef, TRL's aux_loss: from the decoder's router logits, models/moe.py).
Anything else raises a ValueError naming the option when the trainer is built.

Vision-language models run TRL's own VLM path (its processor, image columns, generation and batches): the image
inputs TRL hands its log-prob passes go to the model's multimodal backbone (`lm.model`: image features merged into
the language model's inputs, M-RoPE positions for the Qwen-VL families, Gemma 3's image blocks from token_type_ids),
whose final hidden states the fused ops take in place of TRL's lm_head and log-softmax. The backbone runs per
completion, as in TRL (the native trainer encodes a prompt's images once: models/vision.py). Refused by name: the
tile-indexed layouts (LFM2-VL, InternVL) and a VLM's MoE router loss.

Truncated sampling (top_k > 0, top_p < 1, min_p > 0) keeps TRL 1.16's semantics, for parity with stock TRL: TRL samples
from the truncated distribution (vLLM with `logprobs_mode="processed_logprobs"`, or transformers' warpers) but
computes the old-policy, reference and current log-probs over the whole vocabulary, so its vLLM IS ratio carries
each token's kept mass (TRL PR #7269 measured a mean of 0.896 at top_p 0.8). The kept sets are not replayed here
(they are in grpo_fast's native trainer: README, "Truncated sampling"); building the trainer warns once.
DDP under accelerate / torchrun is tested on 2 CPU (gloo) processes against stock TRL's update
(tests/integrations/test_trl_distributed.py); FSDP and DeepSpeed ZeRO-3 are refused.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib import metadata

TRL_RANGE = ("1.14", "1.17")  # >= first, < second: the versions whose GRPOTrainer this file was checked against


def _check_trl_version() -> None:
    from packaging.version import Version

    wanted = f"trl>={TRL_RANGE[0]},<{TRL_RANGE[1]}"
    try:
        found = metadata.version("trl")
    except metadata.PackageNotFoundError:
        raise ImportError(f"grpo_fast.integrations.trl needs TRL ({wanted}): pip install 'grpo_fast[trl]'") from None
    if not Version(TRL_RANGE[0]) <= Version(found) < Version(TRL_RANGE[1]):
        raise ImportError(
            f"grpo_fast.integrations.trl supports {wanted}, found trl {found}: it overrides GRPOTrainer internals "
            f"(_compute_loss, _get_per_token_logps_and_entropies) checked against those versions only; "
            f"pip install '{wanted}'"
        )


_check_trl_version()

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.models.utils import _ForwardRedirection  # noqa: E402
from trl.trainer.utils import nanmax, nanmin  # noqa: E402

from .. import objective  # noqa: E402
from ..loss_types import LOSS_TYPES, loss_type  # noqa: E402
from ..models.adapter import (  # noqa: E402
    causal_lm_of,
    check_fusable,
    logit_transform,
    masked_logprobs,
    output_head,
)
from ..models.moe import router_loss  # noqa: E402
from ..objective import LossOptions  # noqa: E402
from ..ops import fused_linear_grpo_loss  # noqa: E402
from .trl_vision import (  # noqa: E402
    MULTIMODAL_KEYS,
    completion_hidden,
    image_inputs,
    multimodal_backbone,
    rows_image_inputs,
)

SUPPORTED_LOSS_TYPES = LOSS_TYPES  # the table: TRL 1.16's eight (and any registered since)


# ----------------------------------------------------------------------------------------------
# What the fused path supports
# ----------------------------------------------------------------------------------------------


def check_supported_args(args) -> None:
    """Refuse, naming the option, every GRPOConfig setting the fused loss would silently get wrong."""
    if args is None:  # TRL's defaults are all supported
        return
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"loss_type={args.loss_type!r} is not supported by grpo_fast's fused loss; expected one of "
            f"{list(SUPPORTED_LOSS_TYPES)} (use trl.GRPOTrainer for {args.loss_type!r})"
        )
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.delta is not None and args.delta < 1 + epsilon_high:
        # TRL clips the raw ratio and caps the unclipped one at delta; the fused objective caps first, then
        # clips. The two agree exactly when delta >= 1 + epsilon_high, the only sensible setting.
        raise ValueError(f"delta={args.delta} < 1 + epsilon_high ({1 + epsilon_high}) is not supported by the fused "
                         "loss; use delta >= 1 + epsilon_high or delta=None")


def check_supported_trainer(trainer) -> None:
    """Refuse, naming the option, what only shows once the trainer is built (models, distribution)."""
    check_supported_args(trainer.args)
    if getattr(trainer, "_is_vlm", False):  # images through the model's own multimodal backbone (trl_vision.py)
        multimodal_backbone(causal_lm_of(trainer.accelerator.unwrap_model(trainer.model)))
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError("router_aux_loss_coef (the MoE router loss) with a vision-language model is not supported by "
                             "the fused path (the router logits of the multimodal backbone are untested); unset it or "
                             "use trl.GRPOTrainer")
    if getattr(trainer, "is_fsdp_enabled", False):
        # accelerate turns FSDP on only on accelerators, so no CPU test can run TRL's FSDP path: refused, not guessed
        raise ValueError("FSDP is not supported by the fused path: TRL's FSDP path is untested with grpo_fast's fused "
                         "loss (which reads the whole lm_head weight, and FSDP shards it); DDP is supported (run "
                         "without an FSDP config under accelerate launch or torchrun), or use trl.GRPOTrainer for FSDP")
    if getattr(trainer, "is_deepspeed_enabled", False) and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise ValueError("DeepSpeed ZeRO-3 is not supported by the fused path (the lm_head weight is sharded); "
                         "use ZeRO stage <= 2 or DDP")
    check_fusable(causal_lm_of(trainer.accelerator.unwrap_model(trainer.model)), "model")
    if getattr(trainer, "aux_loss_enabled", False):  # TRL's MoE router loss: a Switch loss we compute, or refused
        router_loss(causal_lm_of(trainer.accelerator.unwrap_model(trainer.model)), trainer.router_aux_loss_coef)
    if trainer.ref_model is not None:
        check_fusable(causal_lm_of(trainer.accelerator.unwrap_model(trainer.ref_model)), "ref_model")
    warn_truncation(trainer.args)


def warn_truncation(args) -> None:
    """Truncated sampling under the TRL backend: TRL's full-vocabulary semantics kept (module docstring), said once."""
    top_k, top_p, min_p = getattr(args, "top_k", 0) or 0, getattr(args, "top_p", 1.0), getattr(args, "min_p", None) or 0.0
    if top_k > 0 or top_p < 1 or min_p > 0:
        import warnings

        warnings.warn(f"top_k={top_k}, top_p={top_p}, min_p={min_p}: the TRL backend keeps TRL 1.16's semantics (the "
                      f"trainer's log-probs over the whole vocabulary while the sampler draws from the truncated "
                      f"distribution), so the vLLM importance-sampling ratio carries each token's kept mass; grpo_fast's "
                      f"native trainer replays the kept sets instead (README, 'Truncated sampling')", stacklevel=3)


def loss_options(trainer) -> LossOptions:
    """grpo_fast's loss options from a TRL trainer: the values GRPOTrainer.__init__ took from its GRPOConfig
    (`epsilon` -> epsilon_low, `epsilon_high` resolved; the rest from the args) and that TRL's own
    _compute_loss reads, with the entropy bonus's coefficient as TRL applies it in this step (the adaptive
    gate: `objective.applied_entropy_coef`) and the model's own logit map (Gemma 2's soft-cap, Cohere's
    scale: `models.adapter.logit_transform`, as TRL's fused lm_head reads them). Built at each loss call, as TRL
    reads them, so a callback that changes `trainer.beta` acts as it does in TRL."""
    args = trainer.args
    defaults = LossOptions()  # for the fields an older TRL (1.14, 1.15) does not have
    arg = lambda name: getattr(args, name, getattr(defaults, name))  # noqa: E731
    coef = 0.0
    if getattr(trainer, "_entropy_bonus_enabled", False):
        coef = objective.applied_entropy_coef(trainer.entropy_coef, trainer._last_world_entropy,
                                              adaptive=trainer.use_adaptive_entropy, target=args.entropy_target)
    return LossOptions(
        loss_type=trainer.loss_type, beta=trainer.beta, epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high, delta=args.delta, temperature=trainer.temperature,
        importance_sampling_level=trainer.importance_sampling_level,
        max_completion_length=trainer.max_completion_length,
        mask_truncated_completions=args.mask_truncated_completions, backend=trainer.fused_backend,
        sapo_temperature_pos=arg("sapo_temperature_pos"), sapo_temperature_neg=arg("sapo_temperature_neg"),
        vespo_k_pos=arg("vespo_k_pos"), vespo_lambda_pos=arg("vespo_lambda_pos"), vespo_k_neg=arg("vespo_k_neg"),
        vespo_lambda_neg=arg("vespo_lambda_neg"), use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        entropy_coef=coef, **logit_transform(causal_lm_of(trainer.accelerator.unwrap_model(trainer.model)).config),
    )


# ----------------------------------------------------------------------------------------------
# The overrides
# ----------------------------------------------------------------------------------------------


class FastGRPOMixin:
    """Replaces GRPOTrainer's log-prob passes and loss; put it before GRPOTrainer in the bases."""

    fused_backend = "auto"  # grpo_fast backend: "auto" (triton on CUDA, cpu on CPU), "triton", "cpu", "torch"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        # The decoder is called directly, not through the wrapper: route the call through the wrapper's
        # forward so DDP still prepares its gradient reduction (as TRL does for Liger).
        unwrapped = self.accelerator.unwrap_model(model)
        if model is not unwrapped:
            return _ForwardRedirection()(model, unwrapped, self._compute_loss, unwrapped, inputs)
        return self._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's per-token log-probs `[B, logits_to_keep]` (and entropies), float32, 0 outside the attention
        mask, here without logits. Used for the old-policy and reference passes (under no_grad). compute_aux_loss:
        the MoE router loss too, TRL's: the mean over the row chunks of each one's (its real tokens').
        With gradients enabled the entropies carry a gradient, as stock TRL 1.16's do (its fused head returns a
        differentiable entropy whatever entropy_coef is), so a subclass may put them in its loss.
        A VLM's image inputs (TRL's keyword arguments: pixel_values, image_grid_thw, num_images, ...) go to its
        multimodal backbone, each row chunk with its own images (`trl_vision.rows_image_inputs`)."""
        unknown = sorted(set(extra) - set(MULTIMODAL_KEYS))
        if unknown:
            raise TypeError(f"_get_per_token_logps_and_entropies() got unexpected keyword arguments {unknown}")
        images = image_inputs(extra)
        options = loss_options(self)
        lm = causal_lm_of(self.accelerator.unwrap_model(model))
        weight, bias = output_head(lm)
        batch_size = batch_size or input_ids.size(0)
        router = router_loss(lm, getattr(self, "router_aux_loss_coef", None)) if compute_aux_loss else None
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):  # row chunks bound the decoder's activations
            ids, att = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            chunk = rows_image_inputs(images, start, start + len(ids), len(input_ids)) if images else {}
            with self.accelerator.autocast():
                hidden, aux = completion_hidden(lm, ids, att, logits_to_keep, router, chunk)
            aux_losses.append(aux)
            logp, entropy = masked_logprobs(hidden, weight, bias, ids[:, -logits_to_keep:], att[:, -logits_to_keep:],
                                            options=options,
                                            differentiable_entropy=compute_entropy and torch.is_grad_enabled())
            logps.append(logp)
            entropies.append(entropy)
        aux_loss = torch.stack(aux_losses).mean() if router is not None else None
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), aux_loss

    def _compute_loss(self, model, inputs):
        """TRL's `_compute_loss` (same loss, gradients and logged metrics) through the fused GRPO loss (a VLM's
        micro-batch with its own image inputs, as TRL splits them)."""
        images = rows_image_inputs(image_inputs(inputs), 0, len(inputs["prompt_ids"]), len(inputs["prompt_ids"]))
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]  # (B,) or (B, T)
        old = inputs.get("old_per_token_logps")  # None: on-policy, old = current.detach()

        lm = causal_lm_of(model)
        weight, bias = output_head(lm)
        router = router_loss(lm, self.router_aux_loss_coef) if getattr(self, "aux_loss_enabled", False) else None
        with self.accelerator.autocast():  # (and the MoE router loss from the same decoder forward)
            hidden, aux = completion_hidden(lm, input_ids, attention_mask, completion_ids.size(1), router, images)
        hidden = hidden.to(weight.dtype)
        if not torch.is_grad_enabled():  # eval: the fused op would otherwise still compute gradients
            hidden, weight, bias = (None if t is None else t.detach() for t in (hidden, weight, bias))
        options = loss_options(self)
        row = loss_type(options.loss_type)
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        tensors = dict(
            old_logp=old, ref_logp=inputs["ref_per_token_logps"] if options.beta != 0.0 else None,
            is_ratio=self._vllm_is_ratio(inputs) if row.takes_is_ratio else None,
            num_items_in_batch=self._dapo_normaliser(inputs, mode) if row.aggregation.global_normaliser else None,
        )
        if self._needs_current_logprobs(old):
            loss, metrics, ratio, entropy, entropy_mask, terms = self._loss_from_logprobs(
                hidden, weight, bias, inputs, mask, advantages, options, accumulation, **tensors)
        else:  # on-policy: one fused pass, loss and gradients together; the ratio is exactly 1
            loss, metrics = fused_linear_grpo_loss(
                hidden, weight, completion_ids, advantages, mask, bias=bias, options=options,
                is_weights=self._policy_token_weights(inputs, advantages, mask, None, None),
                entropy_weights=self._entropy_weights(mask, None, options, accumulation), **tensors,
            )
            ratio, entropy, entropy_mask = self._ones_ratio(mask), None, None
            terms = objective.TokenTerms(None, None, _broadcast(advantages), mask, None, options)
        if not row.aggregation.global_normaliser and mode == "train":  # TRL's accumulation scaling
            loss = loss / self.current_gradient_accumulation_steps
        if aux is not None:  # TRL's: coef x this micro-batch's router loss (its real tokens) / the accumulation
            loss = loss + self.router_aux_loss_coef * aux / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux.detach()).mean().item())
        self._entropy_controller(mode, mask, metrics, entropy, entropy_mask)
        self._log_loss_metrics(mode, mask, ratio, metrics, terms)
        return loss

    # -- pieces of _compute_loss ----------------------------------------------------------------

    def _needs_current_logprobs(self, old) -> bool:
        """Whether anything needs the current log-probs (or entropies) as tensors: the clip metrics'
        per-sequence extremes (old given: the ratio is not 1), the entropy / off-policy masks, vespo's
        weight (logged per sequence, as TRL does)."""
        return (old is not None or self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None
                or not loss_type(self.loss_type).token_local)

    def _loss_from_logprobs(self, hidden, weight, bias, inputs, mask, advantages, options, accumulation, **tensors):
        """Loss through differentiable fused log-probs (and entropies, for the entropy bonus; no logits
        either; the backward recomputes logit chunks: 4 lm_head matmuls instead of 3) and the objective.
        Returns (loss, metrics, ratio for the clip metrics, entropy, high-entropy mask)."""
        logp, entropy = masked_logprobs(hidden, weight, bias, inputs["completion_ids"], inputs["completion_mask"],
                                        options=options, differentiable_entropy=options.entropy_coef != 0.0)
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy.detach(), mask, 1 - self.top_entropy_quantile)
        is_weights = self._policy_token_weights(inputs, advantages, mask, logp.detach(), entropy_mask)
        num_items = tensors.pop("num_items_in_batch")
        loss, metrics = objective.grpo_loss_from_logprobs(
            logp, advantages, mask, options, entropy=entropy, is_weights=is_weights,
            entropy_weights=self._entropy_weights(mask, entropy_mask, options, accumulation),
            num_items_in_batch=num_items, **tensors)
        with torch.no_grad():  # the ratio as TRL's clip metrics read it: [B, 1] at sequence level
            _, ratio, _ = objective.per_token_loss(logp, advantages, mask, dataclasses.replace(options, beta=0.0),
                                                   old_logp=tensors["old_logp"], is_ratio=tensors["is_ratio"])
        ratio = ratio[:, :1] if options.importance_sampling_level == "sequence" else ratio
        old = logp.detach() if tensors["old_logp"] is None else tensors["old_logp"]
        terms = objective.TokenTerms(logp.detach(), old, _broadcast(advantages), mask, tensors["is_ratio"], options)
        return loss, metrics, ratio, entropy.detach(), entropy_mask, terms

    def _entropy_weights(self, mask, entropy_mask, options, accumulation):
        """TRL's entropy bonus weights: the mean over mask and entropy_mask, divided by the accumulation
        steps; for the loss types TRL does not divide by them afterwards (dapo, cispo, vespo), here."""
        if options.entropy_coef == 0.0:
            return None
        covered = mask if entropy_mask is None else mask * entropy_mask
        divisor = accumulation if loss_type(options.loss_type).aggregation.global_normaliser else 1
        return objective.entropy_bonus_weights(mask, entropy_mask, normaliser=covered.sum().clamp(min=1.0) * divisor)

    def _vllm_is_ratio(self, inputs):
        """vespo folds TRL's vLLM importance ratio into its sequence weight (None without vLLM IS)."""
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"].expand_as(inputs["completion_mask"]).float()
        return None

    def _ones_ratio(self, mask):
        sequence = self.importance_sampling_level == "sequence"
        return torch.ones((mask.shape[0], 1 if sequence else mask.shape[1]), device=mask.device)

    def _policy_token_weights(self, inputs, advantages, mask, logp, entropy_mask):
        """Product `[B, T]` of what TRL multiplies the policy-gradient term by before adding the KL term
        (off-policy sequence mask, high-entropy token mask, vLLM importance ratio but for vespo), or None."""
        factors = []
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            factors.append(self.get_off_policy_mask(
                advantages=adv, per_token_logps=logp,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", logp if old is None else old),
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold,
            ))
        if entropy_mask is not None:
            factors.append(entropy_mask)
        if self.use_vllm and self.vllm_importance_sampling_correction and not loss_type(self.loss_type).takes_is_ratio:
            factors.append(inputs["importance_sampling_ratio"])  # (B, T) token modes, (B, 1) sequence modes
        if not factors:
            return None
        weights = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
        for factor in factors:
            weights = weights * factor.float()
        return weights

    def _dapo_normaliser(self, inputs, mode):
        """TRL's dapo denominator: the generation batch's active tokens, rescaled to one accumulation window."""
        normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normaliser

    def _entropy_controller(self, mode, mask, metrics, entropy, entropy_mask):
        """TRL's adaptive entropy controller, on TRL's own attributes (so its checkpoints save and restore
        it): sum the window's entropy over the bonus's tokens; at the optimizer step's end update
        `entropy_coef` from the all-rank token mean (`objective.adaptive_entropy_coef`)."""
        if not getattr(self, "_entropy_bonus_enabled", False):
            return
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(metrics["policy_loss"]).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            if entropy is None:  # the fused route (no token masks): the mask's mean entropy
                stats = torch.stack([metrics["entropy"] * mask.sum(), mask.sum().float()])
            else:
                covered = mask if entropy_mask is None else mask * entropy_mask
                stats = torch.stack([(entropy * covered).sum(), covered.sum().float()])
            stats = stats.detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                args = self.args
                self.entropy_coef = objective.adaptive_entropy_coef(
                    self.entropy_coef, world_entropy, target=args.entropy_target, delta=args.entropy_coef_delta,
                    coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _log_loss_metrics(self, mode, mask, ratio, metrics, terms):
        """Append kl, entropy and the loss type's metrics exactly as TRL's _compute_loss logs them: the
        row's own metrics function, with TRL's global masked mean (per sequence where a value is `[B, 1]`).
        ratio: `[B, T]` or `[B, 1]` (sequence level); metrics: the loss's local masked means."""
        count = mask.sum().float()

        def global_mean(local_sum, local_count):  # over all processes, weighted by their counts
            totals = self.accelerator.reduce(torch.stack([local_sum.float(), local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def global_masked_mean(x):  # TRL: per token, or per sequence when x is [B, 1]
            if x.shape[1] == 1:
                return global_mean(x.sum(), torch.tensor(float(x.shape[0]), device=x.device))
            return global_mean((x * mask).sum(), count)

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        logged = self._metrics[mode]
        if self.beta != 0.0:
            logged["kl"].append(global_mean(metrics["kl"] * count, count))
        logged["entropy"].append(global_mean(metrics["entropy"] * count, count))

        row = loss_type(self.loss_type)
        if row.metrics is not None:
            for name, value in row.metrics(ratio, terms, lambda x: global_masked_mean(x.float())).items():
                logged[name].append(value)
        if "clip_ratio/low_mean" in row.metric_names:  # TRL's per-sequence extremes of the clipped surrogates
            epsilon_low, epsilon_high = terms.options.clip_range
            low = ((ratio < 1 - epsilon_low) & (terms.advantages < 0)).float()
            high = ((ratio > 1 + epsilon_high) & (terms.advantages > 0)).float()
            logged["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            logged["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())


class FastGRPOTrainer(FastGRPOMixin, GRPOTrainer):
    """`trl.GRPOTrainer` with grpo_fast's fused log-prob and loss passes; takes exactly its arguments."""

    def __init__(self, *args, **kwargs):
        # TRL validates its arguments first: a refusal here never hides the error stock TRL would raise
        super().__init__(*args, **kwargs)
        check_supported_trainer(self)  # (the options' refusals included)


FastGRPOTrainer.__init__.__signature__ = inspect.signature(GRPOTrainer.__init__)


def accelerate(trainer, *, backend: str = "auto"):
    """Switch an already-built `trl.GRPOTrainer` (or subclass) to the fused path, in place; returns it.

    Its class becomes a subclass with the fused overrides in front, so a user subclass keeps its own
    methods. backend: the grpo_fast backend ("auto", "triton", "cpu", "torch").
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"accelerate() expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    check_supported_trainer(trainer)
    cls = type(trainer)
    if not issubclass(cls, FastGRPOMixin):
        cls = FastGRPOTrainer if cls is GRPOTrainer else type(f"Fast{cls.__name__}", (FastGRPOMixin, cls), {})
        trainer.__class__ = cls
    trainer.fused_backend = backend
    return trainer


def _broadcast(advantages: torch.Tensor) -> torch.Tensor:
    """`[B]` advantages as `[B, 1]` (broadcast over the tokens); `[B, T]` ones as they are."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages

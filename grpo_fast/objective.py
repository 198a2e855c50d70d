"""The GRPO objective in plain PyTorch, from logits: **the specification**.

Every kernel and backend in grpo_fast is tested against this file, so it stays short and obviously
right. Semantics follow TRL's `GRPOTrainer` (see docs/design.md, "The objective"):

    lp      log-prob of the sampled token under logits / temperature (after the model's own scale and
            soft-cap: `LogitMap`), over the sampler's kept set where it truncated (`KeptSets`)
    ratio   w = exp(lp - old)                                   (token level)
            w = exp(sum_t M (lp - old) / sum_t M)               (sequence level, GSPO)
    loss    l = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)  (w first clamped to <= delta)
                                    grpo, bnpo, dr_grpo, dapo, luspo (the PPO-clipped surrogate)
            l = -sg(min(w, eps_high)) A lp                      cispo
            l = -sigmoid(tau (w - 1)) 4 / tau A                 sapo  (tau by the sign of A)
            l = -sg(phi(W)) A lp                                vespo (W: the sequence's ratio product)
            l *= is_weight;  l += beta * kl,  kl = exp(ref - lp) - (ref - lp) - 1   (times w when
                                                                 use_bias_correction_kl)
    reduce  grpo | sapo (sequence means) | bnpo | dr_grpo | dapo | cispo | vespo (global token
            mean) | luspo (sequence sums)                       (see `loss_weights`)
    bonus   loss -= entropy_coef * sum(H * entropy_weights)      (TRL's entropy bonus)

The loss's static options are one frozen `LossOptions`, validated once when it is built; what
changes from call to call (tensors, the dapo normaliser `num_items_in_batch`) is a call argument.
The loss is split into `token_logprobs` (logits -> lp, entropy) and `grpo_loss_from_logprobs`
(lp -> loss, metrics): the fused ops compute the first part without ever holding logits and reuse
the second part unchanged, so the loss math exists exactly once.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .bounds import FINITE, FINITE_AT_LEAST_0, INTEGER_AT_LEAST_1, POSITIVE_FINITE, Bounds
from .loss_types import LOSS_TYPES, TokenTerms, all_metric_names, loss_type, vespo_weights  # noqa: F401 (re-exported)
from .options import option, options_record, read_config

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
BACKENDS = ("auto", "triton", "cpu", "torch")
SCALE_REWARDS = ("group", "batch", "none")
STD_ESTIMATORS = ("population", "sample")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(allowed)}")


def _bounded(default, bounds: Bounds):
    return field(default=default, metadata={"bounds": bounds})


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------


@options_record
@dataclass(frozen=True)
class LossOptions:
    """The loss's static options, one object for the spec, the ops, the trainer and the TRL adapter.

    Adding a loss option is a field here (an `option`: its default, help and range, which `GRPOConfig`
    takes from here; its range checked by `__post_init__`) plus its math below; the fused ops carry every
    field to their kernels without naming it (grpo_fast/ops/grpo_loss.py).
    """

    loss_type: str = option("dapo", "Token loss and aggregation (TRL): " + " | ".join(  # (from the table: named once)
        f"{name} ({row.summary})" for name, row in LOSS_TYPES.items()) + ". TRL suggests epsilon_high=5 for cispo; "
        "luspo is meant for importance_sampling_level=sequence.", LOSS_TYPES)
    beta: float = option(0.0, "KL coefficient against a frozen reference policy; 0 loads no reference model.",
                         bounds=FINITE_AT_LEAST_0)
    epsilon_low: float = option(0.2, "Lower PPO clip range (and the upper one unless epsilon_high is set).",
                                bounds=FINITE_AT_LEAST_0, config_name="epsilon")  # (TRL's name)
    epsilon_high: Optional[float] = option(None, "Upper PPO clip range (DAPO clip-higher, e.g. 0.28). None: epsilon.",
                                           bounds=FINITE_AT_LEAST_0)
    delta: Optional[float] = option(
        None, "Cap the ratio at delta (> 1) before the PPO clip (two-sided clipping, INTELLECT-2). None: off.",
        bounds=Bounds(low=1, low_open=True, text="> 1 (it caps the ratio from above)"))
    temperature: float = option(
        1.0, "Sampling temperature; training log-probs use logits / temperature, as the sampler does.",
        bounds=POSITIVE_FINITE)  # (declared here, where it must be > 0: the sampler's record mirrors it)
    importance_sampling_level: str = option("token", "Ratio per token (GRPO) or per sequence (GSPO).",
                                            IMPORTANCE_SAMPLING_LEVELS)
    max_completion_length: Optional[int] = _bounded(None, INTEGER_AT_LEAST_1)
    """dr_grpo's constant divisor L; None: the batch's T. Not the config's option of that name (the longest
    completion sampled), though `from_config` sets it from it."""
    mask_truncated_completions: bool = option(
        False, "Leave completions cut at max_completion_length out of the loss (DAPO).")
    backend: str = option("auto", "Fused loss backend: auto (triton on CUDA, cpu on CPU), triton, cpu or torch.",
                          BACKENDS, config_name="loss_backend")
    sapo_temperature_pos: float = option(
        1.0, "sapo: temperature of the sigmoid gate where the advantage is > 0 (TRL).", bounds=POSITIVE_FINITE)
    sapo_temperature_neg: float = option(1.05, "sapo: temperature where the advantage is <= 0 (TRL).",
                                         bounds=POSITIVE_FINITE)
    vespo_k_pos: float = option(2.0, "vespo: shape k of the gamma weight phi(W) = exp(lambda + k log W - lambda W) "
                                "where the advantage is >= 0 (TRL).", bounds=FINITE_AT_LEAST_0)
    vespo_lambda_pos: float = option(3.0, "vespo: rate lambda where the advantage is >= 0 (TRL).",
                                     bounds=FINITE_AT_LEAST_0)
    vespo_k_neg: float = option(3.0, "vespo: k where the advantage is < 0 (TRL).", bounds=FINITE_AT_LEAST_0)
    vespo_lambda_neg: float = option(2.0, "vespo: lambda where the advantage is < 0 (TRL).", bounds=FINITE_AT_LEAST_0)
    logit_scale: float = _bounded(1.0, POSITIVE_FINITE)
    logit_softcap: Optional[float] = _bounded(None, POSITIVE_FINITE)
    """The model's own logit transform (`LogitMap`), not user options: set from the model's config where the
    policy is built (`models.adapter.logit_transform`), so the loss's log-probs are the sampler's."""
    use_bias_correction_kl: bool = False
    """Multiply the KL term by the (differentiable) importance ratio, as TRL does by default; off
    here (the plain k3 estimator), on in `GRPOConfig` (TRL's default, declared there: the defaults differ)."""
    entropy_coef: float = option(0.0, "Entropy bonus (TRL): the loss subtracts entropy_coef x the masked mean token "
                                 "entropy, whatever the loss type; with use_adaptive_entropy, the starting "
                                 "coefficient.", bounds=FINITE)
    """The adaptive controller's gate and coefficient are the trainer's (see `adaptive_entropy_coef`)."""

    def __post_init__(self):
        loss_type(self.loss_type)  # (an unknown name raises, naming the known ones)
        _choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; expected one of {list(BACKENDS)}")
        for name in ("mask_truncated_completions", "use_bias_correction_kl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if torch.compiler.is_compiling():  # dynamo cannot trace the walk over field metadata (a graph break
            return                          # under fullgraph=True); the same options are checked eagerly
        for f in dataclasses.fields(self):
            bounds, value = f.metadata.get("bounds"), getattr(self, f.name)
            optional = f.default is None
            if bounds is not None and not (optional and value is None) and not bounds.holds(value):
                raise ValueError(f"{f.name} must be {bounds.describe()}{' or None' if optional else ''}, got {value!r}")

    @property
    def token_local(self) -> bool:
        """Whether each token's loss depends on its own log-prob only (given the other tensors), so
        its gradient is known as soon as that log-prob is: token-level ratios, and not vespo, whose
        weight needs the whole sequence's ratio first."""
        return self.importance_sampling_level == "token" and loss_type(self.loss_type).token_local

    @property
    def logit_map(self) -> LogitMap:
        return LogitMap(self.temperature, self.logit_scale, self.logit_softcap)

    @property
    def clip_range(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high) with epsilon_high resolved."""
        return self.epsilon_low, self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_config(cls, config, **model) -> "LossOptions":
        """From grpo_fast's `GRPOConfig`: its options (`epsilon` is epsilon_low, `loss_backend` the backend),
        dr_grpo's divisor its max_completion_length and its KL bias correction (whose default differs);
        `model`: the model's logit map (`logit_scale`, `logit_softcap`) where a model is known."""
        return read_config(cls, config, max_completion_length=config.max_completion_length,
                           use_bias_correction_kl=config.use_bias_correction_kl, **model)


def option_warnings(options: LossOptions) -> list[str]:
    """TRL's warnings about combinations that work but are probably not what was meant."""
    out = []
    row = loss_type(options.loss_type)
    own = row.warning(options) if row.warning is not None else None
    if own:
        out.append(own)
    if options.importance_sampling_level == "sequence" and row.token_local and not row.aggregation.per_sequence:
        out.append(f"importance_sampling_level='sequence' with loss_type={options.loss_type!r} sums per-token "
                   "contributions, weighting each sequence by its length; GSPO's setup is loss_type='grpo'")
    return out


def metric_names(options: LossOptions) -> tuple[str, ...]:
    """The metrics the loss reports for these options (TRL's selection: the loss type's own, e.g.
    clip_ratio/* for the clipped surrogates)."""
    return ("kl", "entropy", *loss_type(options.loss_type).metric_names, "policy_loss")


DEFAULT_OPTIONS = LossOptions()


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    std: str = "population",
    eps: float = 1e-4,
    reward_weights: Optional[Sequence[float]] = None,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Group-relative advantages.

    rewards: `[n]` or `[n, k]` (k reward functions), consecutive blocks of `num_generations` rows
    form a group. NaN marks a missing reward (a reward function returned None): it is left out of
    the group statistics, and a sample with nothing known gets advantage 0.
    Returns float32 `[n]`: `(r - group_mean) / (std + eps)`, std per group ("group"), over the whole
    batch ("batch"), or no division ("none", Dr. GRPO). `std="sample"` uses the unbiased estimator
    (TRL); "population" the biased one. With k > 1, "sum_then_normalize" combines the weighted
    rewards first (TRL); "normalize_then_sum" normalises each function per group, then sums.
    """
    _choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _choice("std", std, STD_ESTIMATORS)
    _choice("aggregation", aggregation, REWARD_AGGREGATIONS)
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an integer >= 2 (a group needs a baseline), got {num_generations!r}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape [n] or [n, k], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64).reshape(rewards.shape[0], -1)  # (n, k)
    n, k = rewards.shape
    if n % num_generations != 0:
        raise ValueError(
            f"the number of rewards ({n}) must be a multiple of num_generations ({num_generations})"
        )
    weights = torch.ones(k, dtype=torch.float64) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float64)
    if weights.shape != (k,):
        raise ValueError(f"reward_weights must have one weight per reward function ({k}), got shape {tuple(weights.shape)}")
    if num_generations == 2:
        warnings.warn(
            "num_generations=2: every group of two becomes a full +-1 signal after normalisation, "
            "even when the rewards differ only by evaluator noise",
            stacklevel=2,
        )

    if aggregation == "sum_then_normalize":
        known = ~rewards.isnan().all(dim=1)
        total = torch.nansum(rewards * weights, dim=1)
        return _normalise(torch.where(known, total, torch.nan), num_generations, scale_rewards, std, eps)
    per_function = [_normalise(rewards[:, j], num_generations, scale_rewards, std, eps) for j in range(k)]
    return (torch.stack(per_function, dim=1).double() * weights).sum(dim=1).float()


def _normalise(r: torch.Tensor, num_generations: int, scale_rewards: str, std: str, eps: float) -> torch.Tensor:
    """(r - group mean) / (std + eps) over the known (non-NaN) entries of `r [n]`; 0 where r is NaN."""
    known = ~r.isnan()
    groups_r = r.view(-1, num_generations)  # (G, g)
    groups_known = known.view(-1, num_generations)
    count = groups_known.sum(dim=1, keepdim=True)
    mean = torch.nansum(groups_r, dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(groups_known, groups_r - mean, 0.0)
    correction = 1 if std == "sample" else 0
    if scale_rewards == "group":
        var = (centred**2).sum(dim=1, keepdim=True) / (count - correction).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    elif scale_rewards == "batch":
        r_known = r[known]
        denom = max(r_known.numel() - correction, 1)
        batch_std = ((r_known - r_known.mean()) ** 2).sum().div(denom).sqrt() if r_known.numel() else r.new_zeros(())
        centred = centred / (batch_std + eps)
    return centred.reshape(-1).float()


def correct(rewards: torch.Tensor) -> torch.Tensor:
    """(n,) bool of scored rewards `[n, k]`: the first reward function's value > 0 (the verifier's; missing
    counts as wrong), what the GRPO variants call a correct answer."""
    return torch.nan_to_num(rewards[:, 0], nan=0.0) > 0


def weighted_rewards(rewards: torch.Tensor, weights: Optional[Sequence[float]]) -> torch.Tensor:
    """(n,) weighted sum of scored rewards `[n, k]` over the functions, ignoring missing (NaN) values; NaN where
    every value is missing (TRL). weights: one per function (None: all 1)."""
    w = torch.ones(rewards.shape[1], dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    total = torch.nansum(rewards * w, dim=1)
    return torch.where(rewards.isnan().all(dim=1), torch.nan, total)


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitMap:
    """The lm_head's output `r` -> the logits the sampler draws from, in this order (vLLM's: the model's
    `compute_logits` scales and soft-caps, the sampler then divides by the temperature):

        z = r * scale / T                              without soft-capping
        z = softcap * tanh(r * scale / softcap) / T    with it (Gemma 2's final_logit_softcapping)

    written `z = post * tanh(pre * r)` (or `pre * r`), the two coefficients every backend takes.
    `scale` is the model's multiplier (Cohere's logit_scale; a divisor such as Granite's logits_scaling is
    its inverse: models/adapter.py reads the config). The truncated-sampling kept set comes after the
    temperature."""

    temperature: float = 1.0
    scale: float = 1.0
    softcap: Optional[float] = None

    def __post_init__(self):
        for name in ("temperature", "scale", "softcap"):
            value = getattr(self, name)
            if not (value is None and name == "softcap") and not POSITIVE_FINITE.holds(value):
                raise ValueError(f"{name} must be a positive finite number{' or None' if name == 'softcap' else ''}, "
                                 f"got {value!r}")

    @property
    def pre(self) -> float:
        """The factor on `r` before tanh (or the whole linear map without soft-capping)."""
        return self.scale / (self.temperature if self.softcap is None else self.softcap)

    @property
    def post(self) -> float:
        """The factor after tanh (1 without soft-capping)."""
        return 1.0 if self.softcap is None else self.softcap / self.temperature

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:
            return torch.tanh(logits * self.pre) * self.post
        # (a bare temperature divides, as before the map existed: the same bits)
        return logits / self.temperature if self.scale == 1.0 else logits * self.pre


@dataclass(frozen=True)
class KeptSets:
    """Each position's kept set under truncated sampling (top-k / top-p / min-p), as CSR over N positions.

    ids int64 `[K]`, offsets int64 `[N + 1]` (offsets[0] = 0, offsets[N] = K, non-decreasing): position n's
    set is `ids[offsets[n]:offsets[n + 1]]`, its positions row-major over the `target_ids` they go with
    (`[B, T]` flattened). An EMPTY set means no truncation there: the whole vocabulary (prompt, tool and
    padding positions, or a run that does not truncate). A set holds distinct ids in [0, V) and the
    position's target; the order inside a set does not matter. vLLM's `return_sampling_mask` is this layout.
    `__post_init__` checks types and ranks; `check` the values (against N, V and the targets), which needs
    a device sync, so the ops run it where they read the values anyway."""

    ids: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self):
        for name in ("ids", "offsets"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(f"KeptSets.{name} must be a 1-D int64 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
        if self.offsets.numel() == 0:
            raise ValueError("KeptSets.offsets must have N + 1 entries (N positions), got none")
        if self.ids.device != self.offsets.device:
            raise ValueError(f"KeptSets.ids and offsets must be on one device, got {self.ids.device} and "
                             f"{self.offsets.device}")

    @classmethod
    def from_lists(cls, sets: Sequence[Sequence[int]], device=None) -> "KeptSets":
        """From one list of ids per position (`[]`: no truncation there)."""
        lengths = torch.tensor([len(s) for s in sets], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        ids = torch.tensor([i for s in sets for i in s], dtype=torch.int64)
        return cls(ids.to(device), offsets.to(device))

    @classmethod
    def none(cls, n: int, device=None) -> "KeptSets":
        """N positions without truncation (every set empty)."""
        return cls(torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(n + 1, dtype=torch.int64, device=device))

    @property
    def num_positions(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` int64: each position's set size (0: the whole vocabulary)."""
        return self.offsets.diff()

    @property
    def truncates(self) -> bool:
        """Whether any position has a (non-empty) kept set."""
        return self.ids.numel() > 0

    def entry_rows(self) -> torch.Tensor:
        """`[K]` int64: the position each entry of `ids` belongs to."""
        n = self.num_positions
        return torch.repeat_interleave(torch.arange(n, device=self.ids.device), self.lengths, output_size=self.ids.numel())

    def to(self, device) -> "KeptSets":
        return KeptSets(self.ids.to(device), self.offsets.to(device))

    def select(self, rows: torch.Tensor) -> "KeptSets":
        """The sets of positions `rows` (int64 `[M]`, in that order) as a new KeptSets over M positions."""
        lengths = self.lengths.index_select(0, rows)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        k = int(offsets[-1])
        entry_row = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), lengths, output_size=k)
        src = self.offsets.index_select(0, rows).index_select(0, entry_row) + (
            torch.arange(k, device=rows.device) - offsets.index_select(0, entry_row))
        return KeptSets(self.ids.index_select(0, src), offsets)

    def check(self, n: int, vocab: int, target_ids: Optional[torch.Tensor] = None, name: str = "kept", *,
              first_duplicate=None) -> None:
        """ValueError (one line, naming `name`) unless these are N positions' sets of distinct ids in
        [0, vocab), each non-empty one holding its position's target (`target_ids`, N of them, flattened):
        a target outside its set would have log-prob -inf. first_duplicate: a faster `KeptSets.first_duplicate`
        (the ops pass the native one on the CPU)."""
        offsets, ids = self.offsets, self.ids
        if offsets.numel() != n + 1:
            raise ValueError(f"{name}.offsets must have N + 1 = {n + 1} entries (one set per position of "
                             f"target_ids), got {offsets.numel()}")
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise ValueError(f"{name}.offsets must run from 0 to len(ids) = {ids.numel()}, got {int(offsets[0])} .. "
                             f"{int(offsets[-1])}")
        if n and bool((offsets.diff() < 0).any()):
            bad = int((offsets.diff() < 0).nonzero()[0])
            raise ValueError(f"{name}.offsets must be non-decreasing, got {int(offsets[bad])} then "
                             f"{int(offsets[bad + 1])} at position {bad}")
        if not ids.numel():
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name}.ids must lie in [0, {vocab}) (the vocabulary), found {lo if lo < 0 else hi}")
        bad = (first_duplicate or KeptSets.first_duplicate)(self, vocab)
        if bad is not None:
            pos = int(torch.searchsorted(offsets, torch.tensor(bad, device=offsets.device), right=True)) - 1
            raise ValueError(f"{name}: position {pos} keeps id {int(ids[bad])} twice; a set holds distinct ids")
        if target_ids is not None:
            self.check_targets(target_ids, name)

    def first_duplicate(self, vocab: int) -> Optional[int]:
        """The index (into ids) of an entry whose id its set holds twice, or None (ids in [0, vocab))."""
        key = self.entry_rows() * vocab + self.ids
        sorted_key, order = torch.sort(key, stable=True)  # (position, id) pairs in order: a repeat is a neighbour
        repeat = (sorted_key[1:] == sorted_key[:-1]).nonzero()
        return int(order[1:][repeat[0]]) if repeat.numel() else None

    def check_targets(self, target_ids: torch.Tensor, name: str = "kept", positions: Optional[torch.Tensor] = None) -> None:
        """ValueError unless every non-empty set holds its position's target (`target_ids`, one per position,
        flattened; the sets' structure checked before). positions: the numbers the error names the positions
        by (default 0..N-1: a caller that selected some positions passes their original ones)."""
        if not self.truncates:
            return
        ids, n = self.ids, self.num_positions
        target = target_ids.reshape(-1).to(ids.device, torch.int64)
        rows = self.entry_rows()
        hits = torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(
            0, rows, (ids == target.index_select(0, rows)).to(torch.int64))
        missing = (hits == 0) & (self.lengths > 0)
        if bool(missing.any()):
            at = int(missing.nonzero()[0])
            pos = at if positions is None else int(positions[at])
            raise ValueError(f"{name}: the target id {int(target[at])} at position {pos} is not in its kept set "
                             f"({int(self.lengths[at])} ids): its log-prob would be -inf")

    def keep_mask(self, vocab: int) -> torch.Tensor:
        """`[N, vocab]` bool, True where an id is kept (everywhere for an empty set): the specification's form,
        O(N V), never the fused ops'."""
        mask = torch.zeros(self.num_positions, vocab, dtype=torch.bool, device=self.ids.device)
        mask[self.entry_rows(), self.ids] = True
        return mask | (self.lengths == 0).unsqueeze(-1)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0, *,
                   logit_scale: float = 1.0, logit_softcap: Optional[float] = None, kept: Optional[KeptSets] = None):
    """Log-prob of `target_ids` and entropy under `LogitMap(temperature, logit_scale, logit_softcap)(logits)`
    (`logits / temperature` by default), both float32 `[...]`.

    kept: each position's kept set under truncated sampling (`KeptSets` over target_ids' positions,
    row-major), or None. Where a position's set is non-empty, the log-softmax runs over that set only
    (vLLM's order: scale -> soft-cap -> / temperature -> the kept set -> log-softmax), so the log-prob is
    the one the truncated sampler drew the token with, and the entropy is that of the same renormalised
    kept distribution (the distribution that was sampled: its entropy bonus and metric). An empty set, or
    kept=None, is the whole vocabulary, bit for bit as without kept."""
    z = LogitMap(temperature, logit_scale, logit_softcap)(logits.float())
    if kept is None:
        logp = torch.log_softmax(z, dim=-1)
        lp = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return lp, entropy
    kept.check(target_ids.numel(), z.shape[-1], target_ids)
    keep = kept.keep_mask(z.shape[-1]).view(z.shape)
    logp = torch.log_softmax(z.masked_fill(~keep, -torch.inf), dim=-1)
    lp = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    # p log p is 0 outside the set; written with a finite log p there, so no 0 * -inf reaches the gradient
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return lp, entropy


def per_token_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
):
    """Token losses before aggregation: `(per_token, ratio, kl)`, all shaped like `logp`.

    When `options.token_local`, everything is elementwise, so any slice of tokens (`[N]` or
    `[B, T]`) works and `mask` is not read; the fused ops call this on chunks of tokens. Sequence
    level and vespo need whole rows `[B, T]` and the mask. `advantages` is `[B]` (broadcast over T)
    or shaped like `logp`. is_weights: what the policy-gradient term is multiplied by (TRL's
    off-policy and high-entropy masks, the vLLM importance ratio). is_ratio: vespo only, the vLLM
    importance ratio, which vespo folds into its weight instead. `kl` is None without ref_logp.
    """
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={options.beta} needs ref_logp (the reference policy's log-probs), got None")
    row = loss_type(options.loss_type)
    if is_ratio is not None and not row.takes_is_ratio:
        raise ValueError(f"is_ratio is vespo's; with loss_type={options.loss_type!r} pass the ratio in is_weights")
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() < logp.dim() else adv  # (B, 1) or like logp
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)

    log_ratio = logp - old
    if options.importance_sampling_level == "sequence":
        m = mask.to(logp.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    kl = None
    if ref_logp is not None:
        d = ref_logp.to(logp.dtype) - logp
        kl = torch.exp(d) - d - 1  # k3 estimator
        if options.use_bias_correction_kl:  # TRL: times the raw ratio, differentiable, before any cap
            kl = kl * ratio

    if row.caps_ratio_at_delta and options.delta is not None:  # two-sided clipping (INTELLECT-2)
        ratio = torch.clamp(ratio, max=options.delta)
    per_token = row.surrogate(ratio, TokenTerms(logp, old, adv, mask, is_ratio, options))
    if is_weights is not None:  # as TRL: the IS correction and the masks scale the policy-gradient term only
        per_token = per_token * is_weights.to(logp.dtype)
    if options.beta != 0.0:
        per_token = per_token + options.beta * kl
    return per_token, ratio.expand_as(logp), kl


def loss_weights(mask: torch.Tensor, options: LossOptions = DEFAULT_OPTIONS, num_items_in_batch=None) -> torch.Tensor:
    """Per-token weights `[B, T]` with `loss = sum(per_token * weights)` for every loss type.

    Every aggregation is linear in the token losses with weights known before the pass, which is
    what lets the fused kernels produce gradients in the same pass as the forward.
    num_items_in_batch: the normaliser of dapo, cispo and vespo (a number or a scalar tensor);
    None: the mask's sum.
    """
    return loss_type(options.loss_type).aggregation.weights(mask.to(torch.float32), options, num_items_in_batch)


def entropy_bonus_weights(mask: torch.Tensor, entropy_mask: Optional[torch.Tensor] = None,
                          normaliser=None) -> torch.Tensor:
    """Per-token weights `[B, T]` of the entropy bonus `sum(H * weights)`: TRL's masked token mean of
    the entropy over `mask` and `entropy_mask` (its high-entropy tokens), whatever the loss type.
    normaliser: what the weighted sum is divided by (default: the tokens it covers); TRL's trainer
    also divides by the gradient-accumulation steps, a trainer passes that product here."""
    m = mask.to(torch.float32)
    if entropy_mask is not None:
        m = m * entropy_mask.to(torch.float32)
    normaliser = m.sum() if normaliser is None else torch.as_tensor(normaliser, dtype=m.dtype)
    return m / normaliser.clamp(min=1.0)


@torch.no_grad()
def off_policy_mask(advantages, logp, sampling_logp, mask, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2) `[B, 1]` (or like `advantages` when `[B, T]`):
    1 keeps a sequence, 0 drops it when its advantage is < 0 and its mean log-prob gap
    `sampling_logp - logp` over the mask is > threshold. A NaN gap (a token the sampler could not
    score) counts as 0."""
    m = mask.to(torch.float32)
    gap = torch.nan_to_num(sampling_logp.float() - logp.detach().float(), nan=0.0)
    mean_gap = (gap * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages.unsqueeze(-1) if advantages.dim() < logp.dim() else advantages
    return ((adv >= 0) | (mean_gap <= threshold)).to(torch.float32)


@torch.no_grad()
def high_entropy_mask(entropy, mask, quantile: float) -> torch.Tensor:
    """TRL's high-entropy token mask `[B, T]`: 1 where a masked token's entropy is >= the `quantile`
    of the masked tokens' entropies (quantile = 1 - top_entropy_quantile), else 0."""
    active = mask.bool()
    values = entropy.detach().float()[active]
    if values.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.float32)
    threshold = torch.quantile(values, quantile)
    return ((entropy.detach().float() >= threshold) & active).to(torch.float32)


def grpo_loss_from_logprobs(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    entropy: Optional[torch.Tensor] = None,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
):
    """The GRPO loss from per-token log-probs `logp [B, T]` (float32): `(loss, metrics)`.

    entropy, old_logp, ref_logp, is_weights, is_ratio, entropy_weights: `[B, T]` or None (see
    `per_token_loss`, `entropy_bonus_weights`); num_items_in_batch: see `loss_weights`. With
    `options.entropy_coef != 0` the loss subtracts the entropy bonus, differentiable through
    `entropy`. Metrics are detached scalars named as TRL logs them (`metric_names(options)`).
    """
    per_token, ratio, kl = per_token_loss(logp, advantages, mask, options, old_logp=old_logp, ref_logp=ref_logp,
                                          is_weights=is_weights, is_ratio=is_ratio)
    policy_loss = (per_token * loss_weights(mask, options, num_items_in_batch)).sum()
    loss = policy_loss
    if options.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError(f"entropy_coef={options.entropy_coef} needs the per-token entropy, got None")
        weights = entropy_bonus_weights(mask) if entropy_weights is None else entropy_weights
        loss = loss - options.entropy_coef * (entropy * weights.to(entropy.dtype)).sum()
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)
    metrics = loss_metrics(ratio, advantages, mask, options, kl=kl, entropy=entropy,
                           terms=TokenTerms(logp.detach(), old, _broadcast(advantages, logp), mask, is_ratio, options))
    metrics["policy_loss"] = policy_loss.detach()
    return loss, metrics


def loss_metrics(ratio, advantages, mask, options: LossOptions = DEFAULT_OPTIONS, *, kl=None, entropy=None,
                 terms: Optional[TokenTerms] = None):
    """TRL's logged metrics but policy_loss: masked means of kl, entropy and the loss type's own (the
    clipped fractions, cispo's, vespo's weight: its row's `metrics`, which read `terms`)."""
    m = mask.to(torch.float32)
    ratio = ratio.detach()

    def masked_mean(x):
        x = x.detach().float().expand_as(m)
        return (x * m).sum() / m.sum().clamp(min=1.0)

    zero = torch.zeros((), device=ratio.device)
    out = {"kl": masked_mean(kl) if kl is not None else zero,
           "entropy": masked_mean(entropy) if entropy is not None else zero}
    row = loss_type(options.loss_type)
    if row.metrics is not None:
        if terms is None:  # (the adapter's and ops' callers pass the advantages alone; enough but for vespo)
            terms = TokenTerms(None, None, _broadcast(advantages, ratio), mask, None, options)
        out.update(row.metrics(ratio, terms, masked_mean))
    return out


def _broadcast(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`[B]` advantages as `[B, 1]` against `[B, T]` values; `[B, T]` ones as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() < like.dim() else advantages


def grpo_loss_reference(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = DEFAULT_OPTIONS,
    *,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
    kept: Optional[KeptSets] = None,
):
    """GRPO loss from materialised `logits [B, T, V]`: `(loss, metrics)`.

    target_ids `[B, T]` int; advantages `[B]` or `[B, T]`; mask `[B, T]` (1 = completion token);
    old_logp, ref_logp, is_weights, is_ratio, entropy_weights `[B, T]` or None (see
    `grpo_loss_from_logprobs`); num_items_in_batch: see `loss_weights`. The entropy carries a
    gradient only into the entropy bonus (options.entropy_coef != 0). kept: the sampler's kept sets over
    the B T positions (`token_logprobs`): log-probs and entropies over them; old_logp and ref_logp are then
    expected over the same sets (the caller's business: they are numbers here).
    """
    check_loss_inputs(logits.shape[:-1], options, target_ids=target_ids, advantages=advantages, mask=mask,
                      old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights, is_ratio=is_ratio,
                      entropy_weights=entropy_weights)
    logp, entropy = token_logprobs(logits, target_ids, options.temperature, logit_scale=options.logit_scale,
                                   logit_softcap=options.logit_softcap, kept=kept)
    entropy = entropy if options.entropy_coef != 0.0 else entropy.detach()
    return grpo_loss_from_logprobs(logp, advantages, mask, options, entropy=entropy, old_logp=old_logp,
                                   ref_logp=ref_logp, is_weights=is_weights, is_ratio=is_ratio,
                                   entropy_weights=entropy_weights, num_items_in_batch=num_items_in_batch)


def check_loss_inputs(bt, options: LossOptions, *, target_ids, advantages, mask, old_logp=None, ref_logp=None,
                      is_weights=None, is_ratio=None, entropy_weights=None) -> None:
    """Validate the loss's tensors against each other and the options (which checked themselves when
    built) before any work; errors name the argument and the shapes."""
    if options.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={options.beta} needs ref_logp (the reference policy's log-probs), got None")
    if is_ratio is not None and not loss_type(options.loss_type).takes_is_ratio:
        raise ValueError(f"is_ratio is vespo's; with loss_type={options.loss_type!r} pass the ratio in is_weights")
    bt = tuple(bt)
    if len(bt) != 2:
        raise ValueError(f"expected [B, T, ...] inputs, got leading shape {bt}")
    given = {"target_ids": target_ids, "mask": mask, "old_logp": old_logp, "ref_logp": ref_logp,
             "is_weights": is_weights, "is_ratio": is_ratio, "entropy_weights": entropy_weights}
    for name, tensor in given.items():
        if tensor is not None and tuple(tensor.shape) != bt:
            raise ValueError(f"{name} must have shape {list(bt)} (B, T), got {list(tensor.shape)}")
    if tuple(advantages.shape) not in (bt[:1], bt):
        raise ValueError(f"advantages must have shape [{bt[0]}] or {list(bt)}, got {list(advantages.shape)}")


# ----------------------------------------------------------------------------------------------
# The adaptive entropy bonus (TRL's controller)
# ----------------------------------------------------------------------------------------------


def applied_entropy_coef(coef: float, last_entropy: float, *, adaptive: bool, target: float) -> float:
    """The coefficient a step applies: `coef`, or with the adaptive controller `coef` only when the
    previous optimizer step's global token entropy was <= target (+inf before the first: none)."""
    if not adaptive:
        return coef
    return coef if last_entropy <= target else 0.0


def adaptive_entropy_coef(coef: float, step_entropy: float, *, target: float, delta: float, coef_min: float,
                          coef_max: float) -> float:
    """The controller's update at an optimizer step's end, from that step's global token entropy:
    up by delta (to at most coef_max) when the entropy is <= target, else down (to at least coef_min)."""
    if step_entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


# ----------------------------------------------------------------------------------------------
# GRPO variants: reward shaping and advantages (GRPO-LEAD, Stable GRPO, S-GRPO, GRPO-MA, SGPO)
# ----------------------------------------------------------------------------------------------
# "correct" is a boolean tensor: the verifier's (the first reward function's) value > 0.


def _groups(name: str, x: torch.Tensor, num_generations: int) -> torch.Tensor:
    """`x [n]` as `[n / G, G]` float64, or a ValueError naming the function."""
    x = torch.as_tensor(x)
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor [n], got shape {list(x.shape)}")
    if not isinstance(num_generations, int) or num_generations < 1 or x.numel() % num_generations:
        raise ValueError(f"{name}: the number of values ({x.numel()}) must be a multiple of num_generations "
                         f"({num_generations!r})")
    return x.to(torch.float64).view(-1, num_generations)


def lead_length_rewards(correct, lengths, num_generations: int, *, alpha: float = 0.05,
                        wrong_reward: float = -1.0) -> torch.Tensor:
    """GRPO-LEAD's length-dependent accuracy reward `[n]` (float32): a correct answer gets
    `exp(-alpha (len - mu) / (sigma + 1e-6))`, with mu, sigma the mean and sample std of the token
    lengths of its group's correct answers (sigma = 1 with fewer than two); a wrong one `wrong_reward`.
    Shorter correct answers earn more than longer ones; every correct answer earns more than a wrong one
    as long as wrong_reward <= 0."""
    ok = _groups("lead_length_rewards", correct, num_generations).bool()
    length = _groups("lead_length_rewards", lengths, num_generations)
    count = ok.sum(1, keepdim=True)
    mu = torch.where(ok, length, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    var = torch.where(ok, (length - mu) ** 2, 0.0).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    sigma = torch.where(count >= 2, var.sqrt(), 1.0)
    reward = torch.where(ok, torch.exp(-alpha * (length - mu) / (sigma + 1e-6)), wrong_reward)
    return reward.reshape(-1).float()


def difficulty_weights(advantages, correct, num_generations: int, *, A: float = 0.4, B: float = 1.5,
                       rho0: float = 0.75, k: float = 10.0) -> torch.Tensor:
    """GRPO-LEAD's difficulty-aware advantages `[n]` (float32): with rho the group's share of correct
    answers and `w(x) = A + (B - A) / (1 + exp(k (x - rho0)))`, a positive advantage is multiplied by
    w(rho) (hard prompts, few correct: larger), the others by w(1 - rho)."""
    adv = _groups("difficulty_weights", advantages, num_generations)
    rho = _groups("difficulty_weights", correct, num_generations).bool().double().mean(1, keepdim=True)
    w = lambda x: A + (B - A) / (1 + torch.exp(k * (x - rho0)))  # noqa: E731
    return torch.where(adv > 0, adv * w(rho), adv * w(1 - rho)).reshape(-1).float()


def noise_aware_weights(rewards, num_generations: int, *, p: float) -> torch.Tensor:
    """Stable GRPO's per-sample weight `w* [n]` (float32) for rewards in [0, 1] flipped at rate p in
    [0, 0.5): with r the group's mean reward and t = clip((r - p) / (1 - 2p), 0, 1) its de-noised
    estimate, `w* = (1 - 2p) t(1 - t) / (sqrt(r(1 - r) + 1e-8) sqrt(t(1 - t) + 1e-8))`; the advantage is
    `w* (r_i - r) / (std + eps)`. Groups whose mean is within the noise (t = 0 or 1) get 0."""
    if not (isinstance(p, (int, float)) and 0 <= p < 0.5):
        raise ValueError(f"noise_aware_weights: p (the reward flip rate) must be in [0, 0.5), got {p!r}")
    r = _groups("noise_aware_weights", rewards, num_generations)
    if bool(((r < 0) | (r > 1) | r.isnan()).any()):
        raise ValueError("noise_aware_weights: rewards must lie in [0, 1] (a verifier's 0/1 or a probability), "
                         f"got values in [{float(r.min())}, {float(r.max())}]")
    mean = r.mean(1, keepdim=True)
    t = ((mean - p) / (1 - 2 * p)).clamp(0.0, 1.0)
    w = (1 - 2 * p) * t * (1 - t) / (torch.sqrt(mean * (1 - mean) + 1e-8) * torch.sqrt(t * (1 - t) + 1e-8))
    return w.expand_as(r).reshape(-1).float()


def decaying_serial_rewards(correct) -> torch.Tensor:
    """S-GRPO's serial-group rewards `[m + 1]` (float32), members in exit order (shortest first, the
    full completion last): the i-th correct member gets 1 / 2^(i - 1), a wrong one 0. Its advantages
    are `r - mean(r)` (no std)."""
    ok = torch.as_tensor(correct)
    if ok.dim() != 1 or ok.numel() == 0:
        raise ValueError(f"decaying_serial_rewards: expected a non-empty 1-D tensor [m + 1], got shape {list(ok.shape)}")
    ok = ok.bool()
    rank = torch.cumsum(ok.long(), 0) - 1  # 0 for the first correct one
    return torch.where(ok, 0.5 ** rank.double(), 0.0).float()


def thought_answer_advantages(rewards, *, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO-MA's advantages from `rewards [P, K, M]` (P prompts, K thoughts, M answers per thought):
    `(thought [P, K], answer [P, K, M])` float32. V_k = the mean of thought k's answer rewards; thought
    advantage (V_k - mean_k V) / (std_k V + eps); answer advantage (R - mean R) / (std R + eps) over the
    prompt's K M answers; population std in both."""
    r = torch.as_tensor(rewards)
    if r.dim() != 3:
        raise ValueError(f"thought_answer_advantages: rewards must be [P, K, M], got shape {list(r.shape)}")
    r = r.to(torch.float64)
    value = r.mean(-1)  # (P, K)
    thought = (value - value.mean(-1, keepdim=True)) / (value.std(-1, correction=0, keepdim=True) + eps)
    flat = r.flatten(1)
    answer = (flat - flat.mean(-1, keepdim=True)) / (flat.std(-1, correction=0, keepdim=True) + eps)
    return thought.float(), answer.view_as(r).float()


def partial_credit_rewards(rewards, correct, step_scores, num_generations: int, *, beta: float = 5.0,
                           gamma: float = 0.5) -> torch.Tensor:
    """SGPO's partial credit `[n]` (float32): in a group with no correct answer, each answer's reward
    becomes `sigmoid(beta (step_score - gamma))`, step_score in [0, 1] the share of its reasoning right
    before the first wrong step (more right -> more reward, still below 1); other groups keep theirs,
    so an all-wrong group still carries a signal."""
    r = _groups("partial_credit_rewards", rewards, num_generations)
    ok = _groups("partial_credit_rewards", correct, num_generations).bool()
    s = _groups("partial_credit_rewards", step_scores, num_generations)
    if bool(((s < 0) | (s > 1) | s.isnan()).any()):
        raise ValueError("partial_credit_rewards: step_scores must lie in [0, 1], got values in "
                         f"[{float(s.min())}, {float(s.max())}]")
    none_correct = ~ok.any(1, keepdim=True)
    return torch.where(none_correct, torch.sigmoid(beta * (s - gamma)), r).reshape(-1).float()


# ----------------------------------------------------------------------------------------------
# The MoE router's load-balancing loss (Switch Transformer; TRL's aux_loss)
# ----------------------------------------------------------------------------------------------


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        token_mask: Optional[torch.Tensor] = None, *, return_assignments: bool = False):
    """The Switch Transformer's load-balancing loss of one forward (a float32 scalar), as transformers' MoE
    causal LMs define it (`load_balancing_loss_func` of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, ...,
    5.19): every layer's routed tokens pooled into one set, p = softmax over the experts of a token's router
    logits (in float32),

        f_e = sum_{l,t} m_t [e in top_k(p_lt)] / (n L)    (the share of tokens sent to e; sums to top_k over e)
        P_e = sum_{l,t} m_t p_lte / (n L)                 (the mean probability of e)
        loss = E sum_e f_e P_e                            (top_k when the routing is uniform)

    router_logits: one [N, E] tensor per MoE layer (E = num_experts), row t the router logits of the
    forward's t-th token (its rows flattened: a packed row's L tokens, or a padded [B, L] batch's B L);
    token_mask: 1-D [N], which rows are real tokens (None: all), m above; n = sum_t m_t, L the layers.
    The gradient flows through P only. transformers' function takes a 2-D padding mask, and the causal
    LM's forward hands it the forward's own attention mask (which a packed row's 4-D block mask breaks):
    a 1-D mask over the forward's rows gives a packed row and a padded batch one definition, equal to the
    model's own value on the same real tokens. Layer by layer, as transformers does: O(N E) beside the logits.

    return_assignments: also return `[layers, E]` float32 (no grad), per layer how many of the real
    tokens' top-k choices went to each expert (`max_expert_load` reads them)."""
    if not router_logits:
        raise ValueError("router_logits: expected one [tokens, experts] tensor per MoE layer, got none")
    shapes = {tuple(x.shape) for x in router_logits}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[1] != num_experts:
        raise ValueError(f"router_logits: expected every layer's as [tokens, {num_experts}], got shapes {sorted(shapes)}")
    n = next(iter(shapes))[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if token_mask is not None and tuple(token_mask.shape) != (n,):
        raise ValueError(f"token_mask: expected shape [{n}] (one flag per router row), got {list(token_mask.shape)}")
    device = router_logits[0].device
    mask = torch.ones(n, device=device) if token_mask is None else token_mask.to(device, torch.float32)
    assignments = torch.zeros(len(router_logits), num_experts, device=device)
    prob_sum = torch.zeros(num_experts, device=device)
    for layer, logits in enumerate(router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.detach().topk(top_k, dim=-1).indices  # [N, top_k]
        assignments[layer].scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * mask[:, None]).sum(0)
    rows = mask.sum() * len(router_logits)
    loss = num_experts * (assignments.sum(0) / rows * prob_sum / rows).sum()
    return (loss, assignments) if return_assignments else loss


def max_expert_load(assignments: torch.Tensor) -> float:
    """The busiest expert's load against a balanced one, in the worst layer: max over layers of
    max_e a_le / mean_e a_le, for `assignments [layers, E]` (`load_balancing_loss`'s, summed over a step's
    forwards). 1 = balanced; E / top_k = one expert takes every token of a layer. NaN without tokens."""
    counts = torch.as_tensor(assignments, dtype=torch.float64)
    per_layer = counts.sum(-1)
    if not counts.numel() or not bool((per_layer > 0).all()):
        return float("nan")
    return float((counts.max(-1).values / (per_layer / counts.shape[-1])).max())

"""The rollout engine interface: `Completion`, the sampling options, a request and its validation.

Both engines (`VLLMEngine`, `HFEngine`) take token ids and return, per prompt, a group of `n`
completions with the log-prob of every sampled token under the *processed* distribution the token
was drawn from: logits / temperature, then top-k / top-p masking and renormalisation (vLLM's
`processed_logprobs`). Greedy decoding (temperature 0) reports the log-softmax of the raw logits.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import re
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Optional, Sequence, Union

from ...bounds import FRACTION_OPEN_LOW, INTEGER_AT_LEAST_0, Bounds
from ...options import mirror, option, options_record, read_config

if TYPE_CHECKING:
    import torch

    from ..truncation import KeptTokens

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    token_ids: generated ids, including the stop / EOS token when it ended on one.
    logprobs:  one float per generated token: its log-prob under the processed sampling distribution.
    finish_reason: "stop" (EOS or a stop token) or "length" (max_new_tokens or max_model_len reached);
               None: still running when a partial-rollout round stopped (`generate_until`).
    text:      the decoded completion, special tokens skipped ("" from `generate_until`).
    routed_experts: with routing recorded (an engine built with record_routing, an MoE policy), the experts of
               each sampled token's step, [len(token_ids), num_hidden_layers, top_k] int16 (models/routing.py);
               else None.
    kept:      with truncated sampling, where the engine returns them, each token's kept set (the support its
               log-prob is normalised over; generation/truncation.py's `KeptTokens`); else None.
    image_inputs: a prompt with images: its image processor outputs (pixel_values, image_grid_thw, ...), one dict
               shared by the prompt's n completions (processed once: generation/images.py); else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Optional[FinishReason]
    text: str
    routed_experts: Optional["torch.Tensor"] = None
    kept: Optional["KeptTokens"] = None
    image_inputs: Optional[dict] = None


@dataclass(frozen=True)
class Continuation:
    """One request of a partial-rollout round: a prompt followed by what its completion has so far
    (nothing, for a new one), the tokens it may still add, and its sampling seed."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int


@dataclass
class Round:
    """What `generate_until` returns: per request (those given, then those `more` added, in order)
    the tokens of this round (`finish_reason` None: stopped with the round) and the engine step it
    finished at; per engine step, the requests running."""

    completions: list[Completion]
    finished_at: list[Optional[int]]
    running: list[int]

    def busy_fraction(self, capacity: int) -> float:
        """Mean requests running per engine step / the `capacity` the caller keeps running (1: none idled)."""
        return sum(self.running) / (len(self.running) * capacity) if self.running else 1.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy ints too


@options_record
@dataclass(frozen=True)
class SamplingOptions:
    """How the engine samples: one frozen object, checked once here, built once by the trainer
    (`from_config`) and handed to every engine call (`generate`, `generate_until`, the rollout modes,
    partial rollouts); evaluation has its own (`GREEDY`). The engines read its fields.

    temperature: logits / temperature (0: greedy, the raw logits' argmax).
    top_p: keep the smallest token set with this much probability (1.0: off).
    top_k: keep the k most likely tokens (-1, or 0, for off; stored as -1).
    min_p: keep the tokens with at least min_p x the top probability (0 for off; None is stored as 0).
    vLLM's order: temperature, min_p, top_k, top_p (generation/truncation.py).

    A new sampling knob (say `repetition_penalty`) is declared here (`option`: its default, help and range; its check
    below), named bare in `GRPOConfig`'s body where --help should list it, and given its logits processor in
    `generation/engines/hf_engine.py` (`_warpers`). `from_config` reads every field by its name;
    `generation/engines/vllm_engine.py` passes every field to vLLM's `SamplingParams` by its name (so the fields
    take vLLM's names); the trainer, the rollout modes and partial rollouts hand the object on without looking
    inside.
    """

    temperature: float = mirror(1.0)  # (declared by LossOptions: the loss takes log-probs under it too)
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest token set with this much probability (1.0: off).",
                          bounds=FRACTION_OPEN_LOW)
    top_k: int = option(0, "Keep only the k most likely tokens when sampling (0: off). Truncated sampling (top_k, "
                        "top_p < 1 or min_p > 0) trains over each sampled token's kept set (README, \"Truncated "
                        "sampling\"); where only top_p or min_p is given, training runs default top_k to 512 "
                        "(prime-rl's bound: a kept set has at most 512 tokens, memory O(tokens x k)).",
                        bounds=INTEGER_AT_LEAST_0)
    min_p: Optional[float] = option(None, "min-p sampling (TRL's name): keep the tokens whose probability is at least "
                                    "min_p x the most likely token's, applied after the temperature and before top_k "
                                    "(vLLM's order). None or 0: off.", bounds=Bounds(low=0, high=1))

    def __post_init__(self):
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.min_p
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(k) or (k < 1 and k not in (0, -1)):
            raise ValueError(f"top_k must be -1 (or 0) for no top-k filtering, or an int >= 1, got {k!r}")
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1):
            raise ValueError(f"min_p must be in [0, 1] (None or 0: off), got {m!r}")
        object.__setattr__(self, "temperature", float(t))  # frozen: the checked values, normalised once
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", -1 if k in (0, -1) else int(k))
        object.__setattr__(self, "min_p", float(m or 0.0))  # (vLLM's SamplingParams takes a float: 0 is off)

    @classmethod
    def from_config(cls, config, **given) -> "SamplingOptions":
        """A run's sampling: the config's fields, top_k bounded where only top_p or min_p truncates
        (`bounded`)."""
        return read_config(cls, config, **given).bounded()

    def bounded(self) -> "SamplingOptions":
        """top_k defaulted to `truncation.KEPT_SET_BOUND` (512) where top_p < 1 or min_p > 0 truncates without it:
        the kept sets a training run carries are then at most that large (prime-rl's rule)."""
        from ..truncation import KEPT_SET_BOUND

        if self.top_k < 1 and (self.top_p < 1 or self.min_p > 0) and not self.greedy:
            return replace(self, top_k=KEPT_SET_BOUND)
        return self

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps only some tokens (top_k, top_p < 1, min_p > 0; never when greedy): then every
        sampled token has a kept set (generation/truncation.py)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_overrides(self, overrides: dict) -> SamplingOptions:
        """These options with some fields replaced (checked again); an unknown name is refused."""
        if not overrides:
            return self
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"unknown sampling option(s) {unknown}: SamplingOptions has "
                            f"{[f.name for f in fields(self)]}")
        return replace(self, **overrides)


GREEDY = SamplingOptions(temperature=0.0)  # evaluation's: the most likely token, no filtering


def _sampling(sampling: Optional[SamplingOptions], overrides: dict) -> SamplingOptions:
    """An engine call's options: `sampling` (None: the defaults) with the fields given as keywords replaced."""
    if sampling is None:
        sampling = SamplingOptions()
    elif not isinstance(sampling, SamplingOptions):
        raise TypeError(f"sampling must be a SamplingOptions, got {type(sampling).__name__}")
    return sampling.with_overrides(overrides)


@dataclass(frozen=True)
class SamplingRequest:
    """Validated arguments of one `generate` call: what it samples (`sampling`), and how much."""

    n: int
    max_new_tokens: int
    sampling: SamplingOptions
    stop_token_ids: tuple[int, ...]
    seed: Union[int, tuple[int, ...], None]  # one for the call, or one per prompt
    regex: Optional[str] = None  # the output format: decoding constrained to text that matches it (a judge's)

    @property
    def per_prompt_seeds(self) -> bool:
        return isinstance(self.seed, tuple)

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy


def validate_request(
    prompt_ids,
    *,
    n,
    max_new_tokens,
    sampling: SamplingOptions,
    stop_token_ids,
    seed,
    vocab_size: int,
    max_model_len: int,
    regex: Optional[str] = None,
) -> tuple[list[list[int]], SamplingRequest]:
    """Check `generate`'s arguments before any work; return the prompts as lists of int and the request.

    Errors name the argument (and the prompt index), what was expected and what was given.
    """
    if not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids).__name__}")
    if not _is_int(n) or n < 1:
        raise ValueError(f"n (completions per prompt) must be an int >= 1, got {n!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    assert isinstance(sampling, SamplingOptions), type(sampling)
    if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        if len(seed) != len(prompt_ids) or not all(_is_int(s) for s in seed):
            raise ValueError(f"seed: a list of seeds needs one int per prompt ({len(prompt_ids)}), got {list(seed)!r}")
        seed = tuple(int(s) for s in seed)
    elif seed is not None and not _is_int(seed):
        raise ValueError(f"seed must be an int, one int per prompt, or None, got {seed!r}")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"regex (the output format) must be a non-empty regular expression or None, got {regex!r}")
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(f"regex (the output format) {regex!r} is not a regular expression: {err}") from None
    stops = tuple(int(t) for t in (stop_token_ids or ()))
    bad_stops = [t for t in stops if not 0 <= t < vocab_size]
    if bad_stops:
        raise ValueError(f"stop_token_ids must lie in [0, {vocab_size}) (the model's vocabulary), got {bad_stops}")

    prompts = []
    for i, ids in enumerate(prompt_ids):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"prompt_ids[{i}] must be a list of token ids, got {type(ids).__name__}")
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # tensors / arrays too
        if not ids:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
        if not all(_is_int(t) for t in ids):
            raise TypeError(f"prompt_ids[{i}] must hold ints, got {sorted({type(t).__name__ for t in ids})}")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"prompt_ids[{i}] holds token id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {vocab_size})"
            )
        if len(ids) >= max_model_len:
            raise ValueError(
                f"prompt_ids[{i}] has {len(ids)} tokens, which leaves no room for generation within "
                f"max_model_len={max_model_len}; shorten the prompt or raise max_model_len"
            )
        prompts.append([int(t) for t in ids])
    request = SamplingRequest(
        n=int(n),
        max_new_tokens=int(max_new_tokens),
        sampling=sampling,
        stop_token_ids=stops,
        seed=seed if seed is None or isinstance(seed, tuple) else int(seed),
        regex=regex,
    )
    return prompts, request


def hashed_seed(*parts: int) -> int:
    """A 63-bit seed hashed from integers: distinct parts give seeds far apart (vLLM gives the j-th
    completion of a request seed + j, so neighbouring seeds would share streams)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def prompt_seeds(call_seed: int, n: int, first: int = 0) -> list[int]:
    """One sampling seed per prompt of a call: prompt `first + i` gets hashed_seed(call seed,
    position). A prompt's group then depends on its call seed and its position in the batch only,
    not on which other prompts (or which rank) share the call."""
    return [hashed_seed(call_seed, first + i) for i in range(n)]


# The engine contract: every attribute and method the trainer reads or calls on an engine. An engine
# need not subclass RolloutEngine, but one lacking a member is refused when the trainer is built
# (`check_engine`). Partial rollouts need `runs_partial_rollouts` and `generate_until` besides.
ENGINE_CONTRACT = {
    "vocab_size": "the number of token ids it samples from",
    "max_model_len": "prompt + completion limit in tokens",
    "dtype": "the torch dtype it samples in (the IS correction's default and the sync check's bound read it)",
    "shares_weights_with": "shares_weights_with(model) -> bool: samples with the policy's own weights (no sync, no IS)",
    "generate": "generate(prompt_ids, n=, max_new_tokens=, sampling=, seed=, regex=, on_group=) -> groups of Completion",
    "update_weights": "update_weights(model or (name, tensor) pairs, partial=False): the new policy weights, in place "
                      "(partial: only the tensors given change, e.g. a LoRA adapter's merged layers)",
    "update_adapter": "update_adapter(version, tensors): a LoRA adapter's new A / B (PEFT's layout) as the adapter it "
                      "samples with from now on, the superseded one removed (lora_sync='adapter')",
    "prompt_logprobs": "prompt_logprobs(token_ids) -> log-probs of token_ids[1:] (the sync probe)",
    "reset_prefix_cache": "reset_prefix_cache(): forget cached KV blocks",
    "sleep": "sleep(): release memory during the training part of a step (a no-op where unsupported)",
    "wake": "wake(): restore what sleep released",
    "runs_partial_rollouts": "whether it implements generate_until (partial rollouts)",
    "streams_groups": "whether generate calls on_group as each group finishes (then groups are scored meanwhile)",
}


def check_engine(engine) -> None:
    """Refuse, naming them, the contract members `engine` lacks."""
    missing = [name for name in ENGINE_CONTRACT if not hasattr(engine, name)]
    if missing:
        raise ValueError(f"engine {type(engine).__name__} lacks {missing} of the engine contract "
                         f"(grpo_fast/generation/engines/base.py ENGINE_CONTRACT: {'; '.join(ENGINE_CONTRACT[m] for m in missing)})")


class RolloutEngine:
    """What the trainer sees of an engine (`ENGINE_CONTRACT`). Subclasses implement `_generate`,
    `update_weights`, `prompt_logprobs`, and where they have them `sleep`, `wake`,
    `reset_prefix_cache`, `_generate_until`; they set `vocab_size`, `max_model_len` and `dtype`."""

    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    runs_partial_rollouts = False  # implements `_generate_until`
    streams_groups = False  # `_generate` calls on_group itself, as each group finishes (else: after the call)
    records_routing = False  # its completions carry `routed_experts` (routing replay; built with record_routing)
    returns_kept_sets = False  # under truncated sampling its completions carry `kept` (else the trainer rebuilds them)
    takes_images = False  # `_generate` takes images= and image_inputs= (a vision-language model's prompts)

    def shares_weights_with(self, model) -> bool:
        """Whether it samples with `model`'s own weights (then nothing is synced and no IS is needed)."""
        return False

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (an engine without a prefix cache has nothing to forget)."""

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_new_tokens: int,
        sampling: Optional[SamplingOptions] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        seed: Union[int, Sequence[int], None] = None,
        regex: Optional[str] = None,
        on_group: Optional[Callable[[int, list[Completion]], None]] = None,
        images: Optional[Sequence] = None,
        **options,
    ) -> list[list[Completion]]:
        """Sample `n` completions for every prompt; returns one group (list of n) per prompt, in order.

        prompt_ids: token-id lists (no padding). Generation stops at the model's EOS, any of
        `stop_token_ids` (kept as the last token), `max_new_tokens`, or `max_model_len`.
        sampling: how to sample (None: `SamplingOptions()`, plain sampling at temperature 1); a
        SamplingOptions field given as a keyword (`temperature=0`) replaces that field of it.
        seed: makes this call's sampling reproducible (None: continue the engine's random stream). A
        list gives each prompt its own seed: a prompt's group then depends only on its prompt and
        seed, not on the other prompts of the call, so a batch split over ranks samples the same.
        regex: constrain decoding to text matching it (vLLM's structured outputs; a grammar logits
        processor on HF), e.g. a judge's score format; None: free text.
        on_group(i, group): called with prompt i's group as soon as all its n completions have finished
        (vLLM: while the engine still decodes the other prompts, so they can be scored meanwhile; an
        engine that cannot stream calls it for every group after the batch), in the calling thread.
        images: a vision-language model's prompts: one `generation.images.ImagePrompt` (or None: text only) per prompt;
        prompt_ids then hold each image's placeholder tokens expanded (what the trainer trains on). Each prompt's images
        are processed once, the result shared by its n completions (`Completion.image_inputs`); a completion that samples
        an image placeholder token ends there (`images.placeholder_tokens`).
        """
        from ..images import check_image_prompts, placeholder_tokens, processed

        images = check_image_prompts(images, len(prompt_ids) if isinstance(prompt_ids, Sequence) else -1)
        if images is not None and not self.takes_images:
            raise ValueError(f"images: {type(self).__name__} does not take images (a vision-language model's prompts); "
                             f"use the HF or vLLM engine")
        if images is not None:  # (a sampled image placeholder ends its completion: generation/images.py)
            stop_token_ids = (*(stop_token_ids or ()), *placeholder_tokens(images))
        prompts, request = validate_request(
            prompt_ids,
            n=n,
            max_new_tokens=max_new_tokens,
            sampling=_sampling(sampling, options),
            stop_token_ids=stop_token_ids,
            seed=seed,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            regex=regex,
        )
        if not prompts:
            return []
        extra = {}
        if images is not None:  # each prompt's images processed once, shared by its completions (and its on_group)
            inputs = processed(images)
            extra = {"images": images, "image_inputs": inputs}
            on_group = _with_image_inputs(on_group, inputs) if on_group is not None else None
        # (an engine that does not stream keeps the two-argument _generate)
        groups = (self._generate(prompts, request, on_group, **extra) if self.streams_groups
                  else self._generate(prompts, request, **extra))
        if images is not None:
            for group, shared in zip(groups, extra["image_inputs"], strict=True):
                for c in group:
                    c.image_inputs = shared
        assert len(groups) == len(prompts) and all(len(g) == request.n for g in groups)
        if on_group is not None and not self.streams_groups:
            for i, group in enumerate(groups):
                on_group(i, group)
        return groups

    def _generate(self, prompts: list[list[int]], request: SamplingRequest,
                  on_group: Optional[Callable[[int, list[Completion]], None]] = None) -> list[list[Completion]]:
        raise NotImplementedError

    def generate_until(
        self,
        requests: Sequence[Continuation],
        enough: Callable[[list[bool]], bool],
        *,
        more: Optional[Callable[[list[bool]], Sequence[Continuation]]] = None,
        sampling: Optional[SamplingOptions] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        on_finished: Optional[Callable[[int, Completion], None]] = None,
        **options,
    ) -> Round:
        """Run `requests` (one completion each) step by step until `enough(finished)` is true after a
        step (finished: one flag per request) or every request has finished; abort the rest and
        return what each produced. After every step that was not enough, `more(finished)` may add
        requests (they join the running batch at once: how a round keeps its slots full).
        `sampling` and its fields as keywords: as in `generate`. on_finished(k, completion): called when
        request k finishes, at that step (so its group can be scored while the round runs on).
        Partial rollouts (generation/rounds.py) are built on it."""
        sampling = _sampling(sampling, options)

        def admit(new: Sequence[Continuation]) -> tuple[list[tuple[list[int], int, int]], SamplingRequest]:
            """The requests validated, as (prompt, budget, seed), and the sampling arguments."""
            prompts, request = validate_request(
                [r.prompt_ids for r in new], n=1, max_new_tokens=min((r.max_new_tokens for r in new), default=1),
                sampling=sampling, stop_token_ids=stop_token_ids, seed=[r.seed for r in new],
                vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            return [(p, r.max_new_tokens, r.seed) for p, r in zip(prompts, new, strict=True)], request

        first, request = admit(requests)
        if not first:
            return Round([], [], [])
        extra = {"on_finished": on_finished} if on_finished is not None else {}
        result = self._generate_until(first, request, enough, (lambda f: admit(more(f))[0]) if more else (lambda f: []),
                                      **extra)
        assert len(result.completions) >= len(first)
        return result

    def _generate_until(self, requests: list[tuple[list[int], int, int]], request: SamplingRequest,
                        enough: Callable[[list[bool]], bool],
                        more: Callable[[list[bool]], list[tuple[list[int], int, int]]]) -> Round:
        raise NotImplementedError(f"{type(self).__name__} cannot run partial rollouts (max_staleness >= 1): "
                                  f"use the vLLM engine")

    def update_weights(self, weights, partial: bool = False) -> None:
        """Copy new policy weights (an nn.Module or an iterable of (HF name, tensor)) into the engine;
        partial: the pairs given are a subset, the other weights stay as they are."""
        raise NotImplementedError

    def update_adapter(self, version: int, tensors: dict) -> None:
        """Sample with this LoRA adapter (PEFT's tensor names) from now on, replacing the previous one."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapter path: use lora_sync='merged'")

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 under the engine's weights (raw logits, one
        prefill, nothing sampled): what the trainer's sync check compares with its own."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Release memory between rollouts where the platform supports it (use `asleep`, not sleep/wake pairs)."""

    def wake(self) -> None:
        """Restore what `sleep` released."""


def _with_image_inputs(on_group: Callable[[int, list[Completion]], None], inputs: list) -> Callable:
    """on_group, its group's completions given their prompt's image inputs first (a streamed group is scored, and
    may be batched, before `generate` returns)."""
    def call(i: int, group: list[Completion]) -> None:
        for c in group:
            c.image_inputs = inputs[i]
        on_group(i, group)

    return call


@contextlib.contextmanager
def asleep(engine: "RolloutEngine", sleeps: bool):
    """The engine asleep for the block (sleep mode, `vllm_enable_sleep_mode`: its memory freed for the training
    passes) and woken after it, also when the block raises, so whatever follows (the weight sync, its probe, an
    evaluation, the next generation) finds it awake; nothing where it does not sleep."""
    if not sleeps:
        yield engine
        return
    engine.sleep()
    try:
        yield engine
    finally:
        engine.wake()

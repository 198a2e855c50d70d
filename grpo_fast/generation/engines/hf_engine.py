"""`HFEngine`: rollouts with transformers `generate` on the policy module itself (no copy).

Where vLLM is missing (the GPU image, plain installs) this is the engine. It shares the policy's
parameters, so `update_weights` has nothing to do. Prompts are left-padded into one batch (or a few
of `batch_size` rows); the `n` samples of a prompt are `n` rows.

Log-probs match vLLM's `processed_logprobs`: temperature, then min-p, then top-k, then top-p are applied by
transformers' warpers in that order (the generation config asks transformers for none of its own, so the order
is ours), and a last processor records the log-softmax of the final scores; the sampled token's entry is gathered
one step later, when the token is known. Masked tokens renormalise away, as in vLLM. Greedy
(temperature 0) records the log-softmax of the raw logits, as vLLM does.

Truncated sampling (top_k, top_p < 1, min_p > 0): a processor after the warpers records each step's kept set
(the tokens they left finite), into `Completion.kept` (generation/truncation.py's `KeptTokens`).

With `record_routing` (routing replay, an MoE policy) it also records the experts each sampled token's step routed
to (`models/routing.py`: the last position of every forward of `generate`), into `Completion.routed_experts`.

A vision-language model's prompts (`images=`, generation/images.py) go to the model's own `generate` with their image
inputs: each prompt's images processed once (`RolloutEngine.generate`), a batch's rows given their prompt's tensors
(concatenated over the rows' images, `batched_image_inputs`) and the image-token types the M-RoPE families read.
transformers' `generate` runs the vision tower on every row of the batch (a prompt's n rows: n times, in the prefill):
the trainer's passes run it once per prompt (models/vision.py).
"""

from __future__ import annotations

import contextlib

import torch

from ...models import routing
from ..truncation import KeptTokens
from .base import Completion, RolloutEngine, SamplingOptions, SamplingRequest


class _RecordSampledLogprobs:
    """Logits processor (last in the list) recording log p(sampled token) of every step."""

    def __init__(self):
        self.logprobs_prev = None  # (B, V) log-softmax of the previous step's final scores
        self.sampled = []  # per step (B, 1)

    def __call__(self, input_ids, scores):
        if self.logprobs_prev is not None:  # input_ids[:, -1] is the token sampled from it
            self.sampled.append(self.logprobs_prev.gather(-1, input_ids[:, -1:]))
        self.logprobs_prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, T_new) log-probs, given the full generated sequences (B, T_prompt + T_new)."""
        if self.logprobs_prev is not None:
            self.sampled.append(self.logprobs_prev.gather(-1, sequences[:, -1:]))
            self.logprobs_prev = None
        return torch.cat(self.sampled, dim=1) if self.sampled else sequences.new_zeros(sequences.shape[0], 0).float()


class _SampleRowsWithOwnGenerators:
    """Logits processor (after the recorder) for per-prompt seeds: samples each row's next token with
    that row's own generator and leaves only it possible, so transformers' sampling must pick it. A
    row's tokens then depend on its seed alone, not on the other rows of the batch."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    def __call__(self, input_ids, scores):
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        forced = torch.full_like(scores, -float("inf"))
        return forced.scatter_(1, chosen[:, None], 0.0)


class _RecordKeptSets:
    """Logits processor (after the warpers) recording each step's kept set: the tokens the warpers left finite,
    the support of the distribution the step samples from (truncated sampling: generation/truncation.py)."""

    def __init__(self):
        self.steps = []  # per step: (ids int32 [M], row of each id [M])

    def __call__(self, input_ids, scores):
        rows, ids = scores.isfinite().nonzero(as_tuple=True)
        self.steps.append((ids.to(torch.int32).cpu(), rows.cpu()))
        return scores

    def row(self, i: int, end: int) -> KeptTokens:
        """Row i's kept sets of its first `end` steps."""
        sets = [ids[rows == i] for ids, rows in self.steps[:end]]
        counts = torch.tensor([len(x) for x in sets], dtype=torch.int64)
        return KeptTokens(torch.cat(sets) if sets else torch.zeros(0, dtype=torch.int32),
                          torch.cat([counts.new_zeros(1), counts.cumsum(0)]))


def _warpers(options: SamplingOptions) -> list:
    """Temperature, min-p, top-k, top-p: in vLLM's order, as transformers' own warpers (a new sampling
    option's processor goes here, at its place in vLLM's order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if options.greedy:
        return []
    warpers = []
    if options.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(options.temperature))
    if options.min_p > 0:
        warpers.append(MinPLogitsWarper(min_p=options.min_p))
    if options.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=options.top_k))
    if options.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=options.top_p))
    return warpers


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, T_max), padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


class HFEngine(RolloutEngine):
    """Generate with `model.generate` on the live policy module.

    model: a transformers causal LM (the policy being trained); tokenizer: its tokenizer.
    max_model_len: prompt + completion limit (default: the config's max_position_embeddings).
    batch_size: rows (prompts x n) per `generate` call.
    record_routing: record each token's experts (an MoE policy whose routing `models.routing` replays; refused
    otherwise, here).
    """

    def __init__(self, model, tokenizer, *, max_model_len: int | None = None, batch_size: int = 64,
                 record_routing: bool = False):
        if record_routing:
            routing.check_replayable(model)
        self.records_routing = bool(record_routing)
        self.returns_kept_sets = True  # (its own warpers: _RecordKeptSets)
        self.takes_images = is_vision_language(model)  # (a VLM's generate takes pixel inputs)
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        config = model.config.get_text_config()
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 2048))
        self.batch_size = int(batch_size)
        self.eos_ids = self._eos_ids()
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it samples in: its model's."""
        return next(self.model.parameters()).dtype

    def _eos_ids(self) -> set[int]:
        """The model's end-of-sequence ids: the tokenizer's and the generation config's (as vLLM)."""
        ids = set()
        for eos in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    def shares_weights_with(self, model) -> bool:
        return model is self.model

    def update_weights(self, weights, partial: bool = False) -> None:
        """Nothing to copy: this engine generates with the policy module itself."""

    def update_adapter(self, version: int, tensors: dict) -> None:
        """Nothing to load: the policy module carries its live adapter."""

    def _generate(self, prompts: list[list[int]], request: SamplingRequest, on_group=None, images=None,
                  image_inputs=None) -> list[list[Completion]]:
        rows = [p for p in prompts for _ in range(request.n)]
        row_images = [x for x in image_inputs for _ in range(request.n)] if image_inputs else None
        # per-prompt seeds: row j of prompt i samples with its own generator, seeded seed_i + j (as vLLM
        # seeds a request's j-th completion); one seed for the call: the global RNG, seeded once
        row_seeds = [s + j for s in request.seed for j in range(request.n)] if request.per_prompt_seeds else None
        stop_ids = self.eos_ids | set(request.stop_token_ids)
        completions = []
        rng = torch.random.fork_rng(devices=[self.model.device] if self.model.device.type == "cuda" else [])
        with rng if request.seed is not None else contextlib.nullcontext(), _eval_mode(self.model), torch.no_grad():
            if request.seed is not None and not request.per_prompt_seeds:
                torch.manual_seed(request.seed)
            for start in range(0, len(rows), self.batch_size):
                seeds = row_seeds[start : start + self.batch_size] if row_seeds is not None else None
                pixels = row_images[start : start + self.batch_size] if row_images is not None else None
                completions += self._generate_batch(rows[start : start + self.batch_size], request, stop_ids, seeds,
                                                    pixels)
        return [completions[i * request.n : (i + 1) * request.n] for i in range(len(prompts))]

    def _generate_batch(self, rows: list[list[int]], request: SamplingRequest, stop_ids: set[int],
                        row_seeds: list[int] | None, row_images: list | None = None) -> list[Completion]:
        from transformers import GenerationConfig, LogitsProcessorList

        limits = [min(request.max_new_tokens, self.max_model_len - len(r)) for r in rows]
        input_ids, attention_mask = _left_pad(rows, self.pad_id, self.model.device)
        pixels = image_model_inputs(self.model, input_ids, row_images) if row_images is not None else {}
        recorder = _RecordSampledLogprobs()
        kept = _RecordKeptSets() if request.sampling.truncates else None  # (truncated sampling: the kept sets)
        # temperature/top_k/top_p unset (None): transformers adds no warpers of its own, ours below
        # do the processing, in vLLM's order
        config = GenerationConfig(
            do_sample=not request.greedy,
            num_beams=1,
            max_new_tokens=max(limits),
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_id,
        )
        records = routing.recording(self.model, len(rows)) if self.records_routing else contextlib.nullcontext()
        with records as record:
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **pixels,
                generation_config=config,
                logits_processor=LogitsProcessorList([*self._output_format(request.regex), *_warpers(request.sampling),
                                                      *([kept] if kept is not None else []), recorder,
                                                      *self._row_sampler(request, row_seeds)]),
            )
        logprobs = recorder.finish(sequences)
        new_ids = sequences[:, input_ids.shape[1] :]
        routed = None if record is None else record.routed()  # (rows, steps, layers, top_k): step t sampled token t
        if routed is not None and routed.shape[1] != new_ids.shape[1]:
            raise RuntimeError(f"routing record: {routed.shape[1]} forwards for {new_ids.shape[1]} sampled tokens")
        out = [
            self._completion(new_ids[i].tolist(), logprobs[i].tolist(), limits[i], stop_ids,
                             None if routed is None else routed[i])
            for i in range(len(rows))
        ]
        if kept is not None:
            for i, c in enumerate(out):
                c.kept = kept.row(i, len(c.token_ids))
        return out

    def _output_format(self, regex: str | None) -> list:
        """A grammar processor (xgrammar, the library behind vLLM's structured outputs) that masks every
        token leaving `regex`'s language, before the warpers (as vLLM masks before sampling); one per
        `generate` call (it keeps the rows' matcher states), the compiled grammar kept per regex."""
        if regex is None:
            return []
        import xgrammar
        from xgrammar.contrib.hf import LogitsProcessor

        if not hasattr(self, "_grammars"):
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=sorted(self.eos_ids))
            self._grammar_compiler, self._grammars = xgrammar.GrammarCompiler(info), {}
        if regex not in self._grammars:
            self._grammars[regex] = self._grammar_compiler.compile_regex(regex)
        return [LogitsProcessor(self._grammars[regex])]

    def _row_sampler(self, request: SamplingRequest, row_seeds: list[int] | None) -> list:
        if row_seeds is None or request.greedy:
            return []
        device = self.model.device
        return [_SampleRowsWithOwnGenerators([torch.Generator(device).manual_seed(s) for s in row_seeds])]

    def _completion(self, ids: list[int], logprobs: list[float], limit: int, stop_ids: set[int],
                    routed: torch.Tensor | None = None) -> Completion:
        """Cut a padded row (and its routing record) at its first stop token (kept) or at its length limit."""
        end = next((t + 1 for t, tok in enumerate(ids[:limit]) if tok in stop_ids), None)
        reason = "stop" if end is not None else "length"
        end = end if end is not None else limit
        ids = ids[:end]
        return Completion(ids, logprobs[:end], reason, self.tokenizer.decode(ids, skip_special_tokens=True),
                          routed_experts=None if routed is None else routed[:end].clone())


# ---- vision-language models -------------------------------------------------------------------------------------


def is_vision_language(model) -> bool:
    """A transformers VLM: a config with a vision sub-config (its generate takes pixel inputs)."""
    return getattr(model.config, "vision_config", None) is not None


def image_token_id(model_config) -> int:
    token = getattr(model_config, "image_token_id", None)
    return int(token if token is not None else model_config.image_token_index)  # (older LLaVA configs' name)


def batched_image_inputs(per_row: list) -> dict:
    """One batch's image inputs from its rows' (each row: its prompt's processor outputs, or None for a text-only
    row), in row order: tensors indexed by image or patch (Qwen's pixel_values and image_grid_thw, LLaVA's
    pixel_values) are concatenated; those indexed by prompt (Idefics3's [1, images, C, H, W] pixel_values and its
    pixel_attention_mask) are padded with empty images to the most images a row has (the model drops all-zero
    images) and stacked, a text-only row all padding."""
    import torch

    given = [x for x in per_row if x is not None]
    if not given:
        return {}
    out = {}
    for key in given[0]:
        values = [x[key] for x in given]
        if key in ("pixel_values", "pixel_attention_mask") and values[0].dim() == (5 if key == "pixel_values" else 4):
            most = max(v.shape[1] for v in values)
            empty = values[0].new_zeros((1, most, *values[0].shape[2:]))
            rows = []
            for x in per_row:
                v = empty if x is None else x[key]
                rows.append(torch.cat([v, empty[:, : most - v.shape[1]]], dim=1))
            out[key] = torch.cat(rows)
        else:
            out[key] = torch.cat(values)
    return out


def image_model_inputs(model, input_ids: torch.Tensor, row_images: list) -> dict:
    """`generate`'s image keyword arguments for a batch: the rows' image inputs (`batched_image_inputs`) on the model's
    device (floating ones in its dtype), and where the model's forward reads them the token types (1: an image token)
    the M-RoPE families need for their 3-D positions (`mm_token_type_ids`) or Gemma 3 for its image blocks
    (`token_type_ids`)."""
    import inspect

    param = next(model.parameters())
    inputs = {k: (v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device))
              for k, v in batched_image_inputs(row_images).items()}
    named = inspect.signature(model.forward).parameters
    types = (input_ids == image_token_id(model.config)).int()
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in named:
            inputs[key] = types
            break
    return inputs


@contextlib.contextmanager
def _eval_mode(model):
    """Generate without dropout; give the caller's training mode back afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)

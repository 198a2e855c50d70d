"""Generative judges as reward functions: a language model reads the prompt and a completion (or a whole
group) and answers with a score.

- `judge_score` (`JudgeScore`): one request per completion, answered with one number in
  `score_range`, mapped to [0, 1] (so it can also be SGPO's `partial_credit_judge`).
- `judge_rank` (`JudgeRank`, RULER-style): one request per group (`takes_groups`): the judge sees every
  member of the group side by side and answers with one score per member, comma-separated, so the
  scores are relative to each other as GRPO's advantages are.

The judge decodes under its output format (a regular expression; vLLM's structured outputs, or
xgrammar's logits processor on the HF engine) unless `structured_output` is off; then the last match
of the format in its free text is taken. An answer that does not parse, or a score outside the range, is
asked again up to `max_retries` times (a greedy judge would repeat itself: retries sample at
temperature 1), then gives None (a missing value, as TRL treats None). The judge runs on an engine of
its own, in this process (`engine`: vllm | hf | auto), which the policy's weight sync never touches;
reward functions sharing one `JudgeOptions` share one engine (`judge_for`).
"""

from __future__ import annotations

import re
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..bounds import FINITE_AT_LEAST_0, INTEGER_AT_LEAST_0, INTEGER_AT_LEAST_1
from ..options import mirror, option, options_record, read_config

DEFAULT_SCORE_PROMPT = (
    "Rate how well the response answers the question, from {min} (useless) to {max} (perfect).\n\n"
    "Question:\n{prompt}\n\nResponse:\n{completion}\n\nReply with the score only."
)
DEFAULT_RANK_PROMPT = (
    "Here are {n} responses to the same question. Score each from {min} (worst) to {max} (best), "
    "comparing them with each other.\n\nQuestion:\n{prompt}\n\n{completions}\n\n"
    "Reply with {n} scores, comma-separated, in the order of the responses."
)
REQUEST_LOG = 10_000  # the request texts a judge keeps (its most recent), for a look at what it saw


@options_record
@dataclass(frozen=True)
class JudgeOptions:
    """How a judge runs (GRPOConfig's judge_* fields; `from_config`: None without a judge_model)."""

    model: str  # a local folder of a causal LM, or "default" (the default model)
    engine: str = mirror("auto", config_name="judge_engine")  # (declared with the engines' choices)
    prompt: Optional[str] = option(None, "The judge's instruction: a template with {prompt} and {completion} (judge_score) or {completions} (judge_rank, the group's members numbered), and optionally {min}, {max} (judge_score_range) and {n} (the group size). None: a built-in one per reward. The judge's chat template wraps it when it has one.", config_name="judge_prompt")
    temperature: float = option(0.0, "The judge's sampling temperature (0: greedy). Retries of a greedy judge sample at temperature 1 (greedy would repeat the same answer).", bounds=FINITE_AT_LEAST_0, config_name="judge_temperature")
    max_new_tokens: int = option(64, "Most tokens of one judge answer.", bounds=INTEGER_AT_LEAST_1, config_name="judge_max_new_tokens")
    max_retries: int = option(2, "A judge answer that does not parse (or a score outside judge_score_range) is asked again up to this many times, then gives None (a missing reward value), counted in judge/unparsable.", bounds=INTEGER_AT_LEAST_0, config_name="judge_max_retries")
    score_range: tuple = option([0.0, 10.0], "[low, high]: the scores the judge answers with, mapped to [0, 1] as rewards.", config_name="judge_score_range")
    structured_output: bool = option(True, "Decode the judge under its answer format (a regular expression: vLLM's structured outputs, or xgrammar's logits processor on the HF engine), so every answer parses. False: free text, whose last match of the format is taken.", config_name="judge_structured_output")
    dtype: str = "float32"  # the vLLM judge's
    seed: int = 0

    def __post_init__(self):
        lo, hi = self.score_range
        object.__setattr__(self, "score_range", (float(lo), float(hi)))

    @classmethod
    def from_config(cls, config) -> Optional["JudgeOptions"]:
        if config.judge_model is None:
            return None
        return read_config(cls, config, model=config.judge_model, seed=config.seed,
                           dtype=config.vllm_dtype if config.vllm_dtype != "auto" else _auto_dtype())


def _auto_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"  # (a judge's scores need no bf16 speed on a CPU)


def number_pattern(score_range: tuple) -> str:
    """A number as a judge writes it within `score_range`, with at most one decimal: for integer bounds at
    most 100 apart exactly the range (0-10: `(10(\\.0)?|(9|...|0)(\\.[0-9])?)`), else digits enough for it
    (the parse then refuses what lies outside)."""
    lo, hi = score_range
    if float(lo).is_integer() and float(hi).is_integer() and hi - lo <= 100:
        below = sorted(range(int(lo), int(hi)), key=lambda k: (len(str(k)), k), reverse=True)  # (longest first: a
        return f"({int(hi)}(\\.0)?|({'|'.join(map(str, below))})(\\.[0-9])?)"        #  search takes "10", not "1")
    digits = len(str(int(max(abs(lo), abs(hi)))))
    return ("-?" if lo < 0 else "") + f"[0-9]{{1,{digits}}}(\\.[0-9])?"


def render(text) -> str:
    """A prompt or completion as the judge reads it: plain text, or a chat's messages one per line."""
    if isinstance(text, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in text)
    return str(text)


@dataclass
class Judge:
    """One judge model on its own engine: `ask` sends requests and parses the answers; `requests` logs every
    request's text in order (what the judge saw); `metrics()` pops the counters since the last call."""

    options: JudgeOptions
    engine: object
    tokenizer: object
    context: int
    requests: deque = field(default_factory=lambda: deque(maxlen=REQUEST_LOG))
    _counts: dict = field(default_factory=lambda: {"tokens": 0, "seconds": 0.0, "unparsable": 0, "requests": 0,
                                                   "overlong": 0})

    @classmethod
    def start(cls, options: JudgeOptions) -> "Judge":
        """Check the folder (before any weights load), then load the tokenizer and start the engine."""
        import json
        from pathlib import Path

        from transformers import AutoTokenizer

        from ..generation.engines import ENGINE_CHOICES, engine_kind, make_engine
        from ..models.loading import resolve_model_path

        if options.engine not in ENGINE_CHOICES:
            raise ValueError(f"judge_engine must be one of {list(ENGINE_CHOICES)}, got {options.engine!r}")
        try:
            path = resolve_model_path(options.model)
        except ValueError as err:
            raise ValueError(f"judge_model={options.model!r}: {err}") from None
        config = json.loads((Path(path) / "config.json").read_text())
        context = int(config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings") or 2048)
        tokenizer = AutoTokenizer.from_pretrained(path)
        kind = engine_kind(options.engine, loadable_from_disk=True)
        if kind.loads_weights:  # (from the judge's folder)
            context = min(context, 8192)  # (the KV cache of a judge beside the policy's engine)
            engine = make_engine(kind.name, model_path=path, dtype=options.dtype, max_model_len=context,
                                 seed=options.seed, gpu_memory_utilization=0.15)
        else:  # an engine that samples with a live model: the judge's own, loaded here
            import torch
            from transformers import AutoModelForCausalLM

            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
            model.requires_grad_(False)
            engine = make_engine(kind.name, model=model, tokenizer=tokenizer, max_model_len=context)
        return cls(options, engine, tokenizer, context)

    def encode(self, text: str) -> list[int]:
        """The judge's input ids: its chat template around one user message when it has one."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def ask(self, texts: list[str], pattern: str, parse: Callable[[str], Optional[object]]) -> list[Optional[object]]:
        """One answer per text, parsed by `parse` (None: unparsable); decoded under `pattern` when
        structured output is on; unparsable ones asked again up to max_retries times."""
        from ..generation.engines.base import SamplingOptions, hashed_seed

        o = self.options
        start = time.perf_counter()
        self.requests.extend(texts)
        self._counts["requests"] += len(texts)
        ids = [self.encode(t) for t in texts]
        answers: list = [None] * len(texts)
        pending = [i for i, x in enumerate(ids) if len(x) + o.max_new_tokens <= self.context]
        self._counts["overlong"] += len(texts) - len(pending)  # (no room to answer: missing)
        for attempt in range(1 + o.max_retries):
            if not pending:
                break
            temperature = o.temperature if attempt == 0 or o.temperature > 0 else 1.0
            groups = self.engine.generate(
                [ids[i] for i in pending], n=1, max_new_tokens=o.max_new_tokens,
                sampling=SamplingOptions(temperature=temperature),
                seed=[hashed_seed(zlib.crc32(texts[i].encode()), attempt, o.seed) for i in pending],
                regex=pattern if o.structured_output else None)
            for i, (c,) in zip(pending, groups, strict=True):
                self._counts["tokens"] += len(c.token_ids)
                answers[i] = parse(c.text if o.structured_output else _last_match(pattern, c.text))
            pending = [i for i in pending if answers[i] is None]
        self._counts["unparsable"] += len(pending)
        self._counts["seconds"] += time.perf_counter() - start
        return answers

    def scale(self, value: float) -> Optional[float]:
        """A score in score_range mapped to [0, 1]; None outside the range."""
        lo, hi = self.options.score_range
        return (value - lo) / (hi - lo) if lo <= value <= hi else None

    def metrics(self) -> dict:
        """judge/tokens, judge/seconds, judge/unparsable, judge/requests, judge/overlong since the last call."""
        out = {f"judge/{k}": v for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        self._counts["seconds"] = 0.0
        return out

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        _JUDGES.pop(self.options, None)


def _last_match(pattern: str, text: str) -> Optional[str]:
    """The last match of the format in free text (a judge that reasons first), or None; a number right after
    a '/' ("7/10") or inside a longer one is not a match of its own."""
    found = [m.group(0) for m in re.finditer(rf"(?<![\d./])(?:{pattern})(?![\d.])", text)]
    return found[-1] if found else None


_JUDGES: dict = {}  # JudgeOptions -> Judge: reward functions with the same options share one engine


def judge_for(options: JudgeOptions) -> Judge:
    if options not in _JUDGES:
        _JUDGES[options] = Judge.start(options)
    return _JUDGES[options]


def _template(options: JudgeOptions, default: str, needs: str, name: str) -> str:
    prompt = options.prompt if options.prompt is not None else default
    missing = [p for p in ("{prompt}", needs) if p not in prompt]
    if missing:
        raise ValueError(f"judge_prompt for {name}: expected a template with {{prompt}} and {needs}, "
                         f"missing {missing}; got {prompt!r}")
    from ..bounds import _num

    lo, hi = options.score_range
    return prompt.replace("{min}", _num(lo)).replace("{max}", _num(hi))


def _need_judge(judge: Optional[JudgeOptions], name: str) -> JudgeOptions:
    if judge is None:
        raise ValueError(f"reward {name!r} needs a judge model: set judge_model (a local folder of a causal LM, or "
                         f"'default'), or from Python get_reward_funcs([{name!r}], judge=JudgeOptions(model=...))")
    lo, hi = judge.score_range
    if not lo < hi:
        raise ValueError(f"judge_score_range must be [low, high] with low < high, got {list(judge.score_range)}")
    return judge


class JudgeScore:
    """judge_score: the judge scores each completion alone; in [0, 1] (score_range mapped), None when unparsable."""

    __name__ = "judge_score"

    def __init__(self, judge: Optional[JudgeOptions] = None):
        self.options = _need_judge(judge, "judge_score")
        self.template = _template(self.options, DEFAULT_SCORE_PROMPT, "{completion}", "judge_score")
        self.pattern = number_pattern(self.options.score_range)
        self.judge = self.counters = judge_for(self.options)  # (counters: the score stage logs judge/*)

    def __call__(self, prompts, completions, **columns) -> list[Optional[float]]:
        texts = [self.template.replace("{prompt}", render(p)).replace("{completion}", _content(c))
                 for p, c in zip(prompts, completions, strict=True)]
        return self.judge.ask(texts, self.pattern, self._parse)

    def _parse(self, text: Optional[str]) -> Optional[float]:
        try:
            return self.judge.scale(float(text.strip()))
        except (AttributeError, ValueError):
            return None



class JudgeRank:
    """judge_rank (RULER-style): the judge sees a whole group and scores each member against the others;
    called once per group (`takes_groups`); [0, 1] per member, None for the group when unparsable."""

    __name__ = "judge_rank"
    takes_groups = True

    def __init__(self, judge: Optional[JudgeOptions] = None):
        self.options = _need_judge(judge, "judge_rank")
        self.template = _template(self.options, DEFAULT_RANK_PROMPT, "{completions}", "judge_rank")
        self.number = number_pattern(self.options.score_range)
        self.judge = self.counters = judge_for(self.options)

    def __call__(self, prompts, completions, **columns) -> list[Optional[float]]:
        n = len(completions)
        listed = "\n\n".join(f"Response {k + 1}:\n{_content(c)}" for k, c in enumerate(completions))
        text = self.template.replace("{prompt}", render(prompts[0])).replace("{completions}", listed).replace("{n}", str(n))
        pattern = self.number + f"(, {self.number}){{{n - 1}}}" if n > 1 else self.number
        (scores,) = self.judge.ask([text], pattern, lambda t: self._parse(t, n))
        return scores if scores is not None else [None] * n

    def _parse(self, text: Optional[str], n: int) -> Optional[list]:
        try:
            values = [self.judge.scale(float(v)) for v in text.strip().split(",")]
        except (AttributeError, ValueError):
            return None
        return values if len(values) == n and None not in values else None


def _content(completion) -> str:
    """A completion's text: itself, or a conversational completion's last message's content."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)

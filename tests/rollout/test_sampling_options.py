"""`SamplingOptions`: checked once, built once from the config, handed whole to every engine call.

An engine here records the request it is given (no model): what reaches `_generate` and
`_generate_until` is the very options object the caller passed, or it with the keyword fields replaced.
"""

import dataclasses

import pytest

from grpo_fast.config import GRPOConfig
from grpo_fast.generation.engines import GREEDY, RolloutEngine, SamplingOptions
from grpo_fast.generation.engines.base import Completion, Continuation, Round


class Recorder(RolloutEngine):
    vocab_size, max_model_len = 16, 8

    def __init__(self):
        self.requests = []

    def _generate(self, prompts, request):
        self.requests.append(request)
        return [[Completion([1], [0.0], "length", "") for _ in range(request.n)] for _ in prompts]

    def _generate_until(self, requests, request, enough, more):
        self.requests.append(request)
        return Round([Completion([1], [0.0], "length", "") for _ in requests], [1] * len(requests), [len(requests)])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0 = greedy\), got -1.0"),
        ({"temperature": float("inf")}, r"temperature must be"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -5}, r"top_k must be -1 \(or 0\) for no top-k filtering, or an int >= 1, got -5"),
        ({"top_k": 2.0}, r"top_k must be"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\] \(None or 0: off\), got 1.5"),
    ],
)
def test_bad_options_are_refused_when_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingOptions(**kwargs)


def test_from_config_reads_every_field_by_name_and_normalises_once():
    options = SamplingOptions.from_config(GRPOConfig(temperature=0.7, top_p=0.9, top_k=0))
    # top_p without top_k: a run's top_k bounds the kept sets (512, prime-rl's); an engine call keeps what it is given
    assert options == SamplingOptions(temperature=0.7, top_p=0.9, top_k=512)
    assert SamplingOptions.from_config(GRPOConfig(min_p=0.1)).top_k == 512
    assert SamplingOptions.from_config(GRPOConfig(temperature=0.7, top_k=0)) == SamplingOptions(temperature=0.7)
    assert type(options.temperature) is float and not options.greedy and GREEDY.greedy
    assert SamplingOptions(temperature=1, top_k=5).temperature == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 0.0


def test_every_engine_call_gets_the_options_object():
    engine, options = Recorder(), SamplingOptions(temperature=0.5, top_k=3)
    engine.generate([[1, 2]], n=2, max_new_tokens=3, sampling=options, seed=[4])
    engine.generate_until([Continuation([1, 2], 3, 4)], lambda finished: True, sampling=options)
    assert [r.sampling for r in engine.requests] == [options, options]
    assert all(r.sampling is options for r in engine.requests), "handed on, not rebuilt"


def test_keywords_replace_fields_of_the_options():
    engine = Recorder()
    engine.generate([[1, 2]], n=1, max_new_tokens=3)
    engine.generate([[1, 2]], n=1, max_new_tokens=3, temperature=0)
    engine.generate([[1, 2]], n=1, max_new_tokens=3, sampling=SamplingOptions(top_p=0.5), top_k=2)
    engine.generate_until([Continuation([1, 2], 3, 4)], lambda finished: True, temperature=0.8)
    assert [r.sampling for r in engine.requests] == [SamplingOptions(), GREEDY, SamplingOptions(top_p=0.5, top_k=2),
                                                     SamplingOptions(temperature=0.8)]
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['min_q'\].*'temperature', 'top_p', 'top_k'"):
        engine.generate([[1, 2]], n=1, max_new_tokens=3, min_q=0.1)
    with pytest.raises(TypeError, match="sampling must be a SamplingOptions, got dict"):
        engine.generate([[1, 2]], n=1, max_new_tokens=3, sampling={"temperature": 0.5})
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate_until([Continuation([1, 2], 3, 4)], lambda finished: True, top_p=2.0)

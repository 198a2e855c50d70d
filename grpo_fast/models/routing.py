"""Routing replay (R3, arXiv 2510.11370): the trainer's MoE layers route each generated token to the experts the
engine routed it to.

An MoE policy's router picks each token's top-k experts. The engine that sampled a completion and the trainer that
scores it pick them from slightly different numbers (other kernels, other batching; after an update, other
weights), so the experts can differ, and the train/inference mismatch grows with them. Replay records the
engine's choice and makes the trainer's forward use it: for a replayed token, the router's top-k indices are the
recorded ones, while the weights the experts are mixed with still come from the current router logits
(softmax of the logits, read at the recorded experts, as the family computes them), so the gradient reaches the
router through its probabilities of the replayed experts.

The record, per completion: `[C, num_hidden_layers, top_k]` int16, vLLM's `routed_experts` layout (a row per
decoder layer; a dense layer's row is unused). Entry t holds the experts of the position whose hidden state
predicts completion token t: the prompt's last token for t = 0, completion token t - 1 after (the positions of
`PackedMicroBatch.hidden_index`; in the engine, decoding step t). Prompt tokens are routed by the trainer itself.

- `recording(model, rows)`: the HF engine's record of its own `generate`, a step at a time.
- `Replay.of(mb, routed_experts, replay=...)`: one packed micro-batch's record; `replaying(decoder, replay)` routes
  the decoder's forward by it (and, under gradient checkpointing, the backward's recompute: the caller keeps it
  open through the backward) and counts, per token, whether the experts used and the router's own pick differ
  from the engine's (`counts`, `metrics`: `routing/disagreement`, `routing/router_disagreement`).

Families: where transformers 5.19 picks the top-k. Every supported router module returns (router_logits, weights,
experts); replay keeps the logits and replaces the other two (`FAMILIES`). Others (DeepSeek-V3 / GLM4-MoE's
group-limited routing, ...) are refused by model type.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..options import option, options_record


@options_record
@dataclass(frozen=True)
class RoutingOptions:
    """Routing replay's options: read by the engine's build (whether it records) and the trainer's passes (whether
    they replay)."""

    routing_replay: bool = option(
        False, "Routing replay (R3), MoE policies: the engine records the experts each generated token is routed to "
        "(top-k ids per MoE layer) and the trainer's forwards (training and old-policy log-probs; not the reference) "
        "route those tokens to the same experts, the mixing weights still from the trainer's router (its gradient "
        "flows through them). Logs routing/disagreement (0 under replay) and routing/router_disagreement (what the "
        "trainer's router would pick instead). Costs memory for num_hidden_layers x top-k expert ids (int16) per "
        "generated token, and the trainer no longer follows its own routing for generated tokens. Needs a "
        "qwen3_moe, qwen2_moe, olmoe, mixtral or gpt_oss model, the parallel rollout mode and max_staleness=0; "
        "vLLM records only in its Model Runner V2 (untested on hardware).")
    record_routing: bool = option(
        False, "Record the engine's routing as routing_replay does and log routing/disagreement (generated tokens the "
        "trainer's router sends to other experts than the engine did, in any MoE layer) without replaying it; "
        "routing_replay records too. Same cost in memory.")

    @property
    def records(self) -> bool:
        """Whether the engine records its routing."""
        return self.routing_replay or self.record_routing


# ---- the families: how a router turns its logits into the mixing weights of chosen experts ----------------------


def _softmax_then_topk(cast: bool) -> Callable:
    """Qwen3-MoE, Qwen2-MoE, OLMoE (cast=True: back to the logits' dtype) and Mixtral (always normalised, float32):
    softmax over all experts in float32, the chosen experts' probabilities, renormalised where the router does."""

    def weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        chosen = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        if getattr(router, "norm_topk_prob", True):  # (Mixtral's router has no flag: it always renormalises)
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return chosen.to(logits.dtype) if cast else chosen

    return weights


def _topk_then_softmax(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: the softmax over the chosen experts' logits alone."""
    return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=logits.dtype)


@dataclass(frozen=True)
class Family:
    router: str  # the class name of its router module (transformers 5.19): forward -> (logits, weights, experts)
    weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (router, logits [N, E], experts [N, k])


FAMILIES = {
    "qwen3_moe": Family("Qwen3MoeTopKRouter", _softmax_then_topk(cast=True)),
    "qwen2_moe": Family("Qwen2MoeTopKRouter", _softmax_then_topk(cast=True)),
    "olmoe": Family("OlmoeTopKRouter", _softmax_then_topk(cast=True)),
    "mixtral": Family("MixtralTopKRouter", _softmax_then_topk(cast=False)),
    "gpt_oss": Family("GptOssTopKRouter", _topk_then_softmax),
}


def _model_type(model: nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def family_of(model: nn.Module) -> Family:
    """The routing family of `model` (a causal LM, its decoder, or a PEFT model); a ValueError naming its model type
    when routing replay does not support it."""
    model_type = _model_type(model)
    if model_type not in FAMILIES:
        raise ValueError(f"routing replay needs a mixture-of-experts model of type {', '.join(FAMILIES)}; "
                         f"got model type {model_type!r} ({type(model).__name__})")
    return FAMILIES[model_type]


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every MoE layer of `model`, in layer order; raises as `family_of`, and
    when the model has no router of its family (a config without MoE layers)."""
    family = family_of(model)
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == family.router:
            layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if layer is None:
                raise ValueError(f"routing replay: cannot tell the decoder layer of router {name!r}")
            found.append((int(layer.group(1)), module))
    if not found:
        raise ValueError(f"routing replay: {type(model).__name__} ({_model_type(model)}) has no {family.router} module")
    return found


def num_layers(model: nn.Module) -> int:
    """Rows of a record: the model's decoder layers (vLLM's layout)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def check_replayable(model: nn.Module) -> None:
    """Refuse, before any work, a model whose routing cannot be recorded and replayed (dense, or an MoE family
    not supported here)."""
    routers(model)


def check_engine(engine) -> None:
    """Refuse an engine whose completions do not carry their routing (one passed in, built without record_routing)."""
    if not getattr(engine, "records_routing", False):
        raise ValueError(f"routing replay needs an engine that records each token's experts (built with "
                         f"record_routing=True); {type(engine).__name__} does not")


def record_tensor(experts) -> torch.Tensor:
    """A record (numpy or tensor, any integer dtype: vLLM returns uint8 / uint16) as the int16 tensor kept."""
    return torch.as_tensor(experts if isinstance(experts, torch.Tensor) else experts.astype("int64")).to(torch.int16)


# ---- the HF engine's record --------------------------------------------------------------------------------------


class Recording:
    """The experts each of `rows` sequences' last position was routed to, per forward of a `generate` (one forward
    per sampled token: the prefill, then one per decoding step)."""

    def __init__(self, model: nn.Module, rows: int):
        self.rows, self.layers = rows, num_layers(model)
        self.steps: dict[int, list[torch.Tensor]] = {layer: [] for layer, _ in routers(model)}

    def hook(self, layer: int):
        def record(module, inputs, output):
            experts = output[2]
            self.steps[layer].append(experts.view(self.rows, -1, experts.shape[-1])[:, -1].to(torch.int16))

        return record

    def routed(self) -> torch.Tensor:
        """(rows, forwards, num_hidden_layers, top_k) int16 on the CPU; dense layers' rows 0."""
        counts = {len(s) for s in self.steps.values()}
        if len(counts) != 1:
            raise RuntimeError(f"routing record: the MoE layers saw different numbers of forwards {sorted(counts)}")
        forwards = counts.pop()
        some = next(iter(self.steps.values()))
        top_k = some[0].shape[-1] if forwards else 1
        out = torch.zeros(self.rows, forwards, self.layers, top_k, dtype=torch.int16)
        for layer, steps in self.steps.items():
            if forwards:
                out[:, :, layer] = torch.stack(steps, dim=1).cpu()
        return out


@contextlib.contextmanager
def recording(model: nn.Module, rows: int):
    """Record, while open, the routing of every forward of `model` over a batch of `rows` sequences (the HF
    engine's `generate`): yields a `Recording`."""
    record = Recording(model, rows)
    handles = [router.register_forward_hook(record.hook(layer)) for layer, router in routers(model)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


# ---- the trainer's replay ------------------------------------------------------------------------------------------


@dataclass
class Replay:
    """The engine's routing of one packed micro-batch's completion tokens, and what a forward did with it.

    positions: (P,) long, the packed positions of the completion tokens (`hidden_index` under the completion mask);
    experts: (P, num_hidden_layers, top_k) long, the engine's experts there; num_tokens: the packed row's length;
    replay: route them so (False: only compare). After a forward, per MoE layer: (P,) bool, whether the experts the
    forward used (`used`) and its router's own top-k (`own`) differ from the engine's as sets.
    """

    positions: torch.Tensor
    experts: torch.Tensor
    num_tokens: int
    replay: bool
    used: dict = field(default_factory=dict)
    own: dict = field(default_factory=dict)

    @classmethod
    def of(cls, mb, routed_experts, *, replay: bool) -> "Replay":
        """The record of micro-batch `mb` (`train.packing.PackedMicroBatch`) from the batch's per-completion
        records `routed_experts` (`Rollouts.routed_experts`, indexed by `mb.rows`)."""
        lengths = mb.completion_mask.sum(dim=1).tolist()
        positions, experts = [], []
        for j, (i, n) in enumerate(zip(mb.rows, lengths, strict=True)):
            record = routed_experts[i]
            if record.dim() != 3 or record.shape[0] != n:
                raise ValueError(f"routed_experts[{i}] has shape {tuple(record.shape)}: expected ({n}, layers, top_k), "
                                 f"one row per completion token of sample {i}")
            positions.append(mb.hidden_index[j, :n])
            experts.append(record)
        device = mb.hidden_index.device
        return cls(torch.cat(positions), torch.cat(experts).to(device=device, dtype=torch.long), mb.num_tokens, replay)

    def hook(self, layer: int, family: Family):
        def route(module, inputs, output):
            logits, weights, own = output
            if own.shape[0] != self.num_tokens:
                raise RuntimeError(f"routing replay: layer {layer}'s router saw {own.shape[0]} tokens, the packed "
                                   f"row has {self.num_tokens}")
            if self.experts.shape[1] <= layer or self.experts.shape[2] != own.shape[-1]:
                raise ValueError(f"routing replay: the record has {self.experts.shape[1]} layers x top-{self.experts.shape[2]}, "
                                 f"the model routes layer {layer} to top-{own.shape[-1]}")
            engine = self.experts[:, layer].to(own.dtype)
            used = own.index_copy(0, self.positions, engine) if self.replay else own
            self.own[layer] = _differs(own[self.positions], engine)
            self.used[layer] = _differs(used[self.positions], engine)
            return (logits, family.weights(module, logits, used), used) if self.replay else None

        return route

    def counts(self) -> list[float]:
        """[tokens compared, tokens routed otherwise than the engine in some layer, tokens the router itself would
        route otherwise]; zeros before a forward."""
        if not self.used:
            return [0.0, 0.0, 0.0]
        used, own = (torch.stack(list(d.values())).any(dim=0) for d in (self.used, self.own))
        return [float(self.positions.numel()), float(used.sum()), float(own.sum())]


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(P,) bool: the rows' expert sets differ (order within top-k does not matter)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


@contextlib.contextmanager
def replaying(decoder: nn.Module, replay: Optional[Replay]):
    """While open, `decoder`'s MoE layers route by `replay` (None: as they would). Keep it open through the
    backward when the decoder recomputes activations (gradient checkpointing runs the routers again there)."""
    if replay is None:
        yield
        return
    family = family_of(decoder)
    handles = [router.register_forward_hook(replay.hook(layer, family)) for layer, router in routers(decoder)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def counts(replays) -> list[float]:
    """The summed `Replay.counts` of micro-batches (None entries skipped)."""
    total = [0.0, 0.0, 0.0]
    for replay in replays:
        if replay is not None:
            total = [a + b for a, b in zip(total, replay.counts(), strict=True)]
    return total


def metrics(total: list[float]) -> dict:
    """The logged figures of summed counts (over micro-batches and ranks): `routing/disagreement` (the fraction of
    generated tokens whose experts in the trainer's forward differ from the engine's in some MoE layer: 0 under
    replay), `routing/router_disagreement` (the fraction the trainer's router would route otherwise: the mismatch
    replay removes), `routing/tokens` (tokens compared)."""
    tokens, used, own = total
    if not tokens:
        return {}
    return {"routing/disagreement": used / tokens, "routing/router_disagreement": own / tokens, "routing/tokens": tokens}

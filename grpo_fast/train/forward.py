"""The policy forward of training: packed rows -> final hidden states -> fused op. No logits.

`model.<base_model_prefix>` (e.g. `LlamaForCausalLM.model`) ends with the final norm, so its output
is what the lm_head would multiply; the lm_head weight goes to the fused op instead, which computes
log-probs (and the loss and its gradient) over vocab chunks without a `[tokens, vocab]` tensor.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from ..compat import attention_implementation
from ..generation import truncation
from ..models import routing, vision
from ..models.adapter import causal_lm_of, decoder_of, logit_transform, output_head, unshard_head
from ..models.moe import router_logits_of
from ..ops import masked_linear_logprobs
from .attention import packed_attention, supports_packed_attention
from .packing import PackedMicroBatch, pack_sequences, plan_group_micro_batches, plan_micro_batches


def policy_parts(model):
    """(decoder ending at the final hidden state, lm_head weight [V, H], lm_head bias [V] or None).

    Found the same way as in the TRL integration (through PEFT wrappers; refuses a head that is not a
    plain Linear, whose adapter the fused op would silently drop). A sharded (FSDP2) weight is
    gathered whole, and its shape checked, so that a shard never passes for the whole weight.
    """
    lm = causal_lm_of(model)
    head = lm.get_output_embeddings()
    unshard_head(head)
    weight, bias = output_head(lm)
    if hasattr(weight, "full_tensor") or tuple(weight.shape) != (head.out_features, head.in_features):
        raise RuntimeError(f"the lm_head weight is sharded ({type(weight).__name__} of local shape "
                           f"{tuple(getattr(weight, '_local_tensor', weight).shape)}) where the fused loss reads it: "
                           f"keep the lm_head in the root FSDP unit (not resharded after forward) or make it a unit "
                           f"of its own, so that a shard never passes for the whole weight")
    return decoder_of(lm), weight, bias


def completion_hidden(base, mb: PackedMicroBatch, amp_dtype: Optional[torch.dtype] = None, forward=None, *,
                      router_logits: bool = False):
    """(b, Tc, H): for each sequence, the hidden states predicting its completion tokens.

    amp_dtype: run the decoder under `torch.autocast` in this dtype (mixed precision: matmuls in
    bf16, weights and the residual stream as they are); the hidden states come back in the
    weights' dtype, so the fused op after it computes as without autocast. forward: what to call
    instead of `base` itself (the DDP-wrapped policy, whose forward is the decoder's).
    router_logits: an MoE decoder's router logits of the same forward too, `(hidden, router logits)`:
    one [L, E] tensor per MoE layer, a row per token of the packed row (all real: no padding there).
    A row with images (a VLM, `mb.images`): the image encoder runs first, once per distinct prompt (`image_inputs`).
    """
    param = next(base.parameters())
    attention = packed_attention(vision.language_model_of(base)) if mb.attention == "packed" else contextlib.nullcontext()
    inputs = mb.model_inputs()
    if mb.images is not None:
        with torch.autocast(param.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            inputs.update(image_inputs(base, mb))
    if mb.attention == "mask" and attention_implementation(base.config) == "eager":
        # eager attention adds the mask to the scores: a bool mask would add 1 and 0 (a packed tiny GPT-OSS's hidden
        # states were off by up to 0.97, a Llama's by 4.5), so it gets the additive form transformers builds
        inputs["attention_mask"] = torch.zeros(mb.attention_mask.shape, dtype=param.dtype, device=param.device
                                               ).masked_fill(~mb.attention_mask, torch.finfo(param.dtype).min)
    extra = {"output_router_logits": True} if router_logits else {}
    with attention, torch.autocast(param.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        out = (forward or base)(**inputs, **extra)
    hidden = out.last_hidden_state[0][mb.hidden_index].to(param.dtype)  # (1, L, H) -> (b, Tc, H)
    return (hidden, router_logits_of(out)) if router_logits else hidden


def image_inputs(base, mb: PackedMicroBatch) -> dict:
    """A VLM row's encoder outputs as its backbone takes them (`mm_encoder_outputs`): the encoder once per distinct
    prompt of the row, each prompt's features shared by the sequences that show them (models/vision.py)."""
    outputs = vision.row_encoder_outputs(vision.encoder_outputs(base, mb.images), mb.images)
    if outputs is None:
        return {}
    if vision.takes_encoder_outputs(base):
        return {"mm_encoder_outputs": outputs}
    return {"input_ids": None, "inputs_embeds": vision.merged_embeddings(base, mb.input_ids, outputs)}


def attention_mode(model) -> str:
    """How a packed row keeps its sequences apart (grpo_fast.train.packing): flash-attention's varlen
    kernel, else grpo_fast's per-sequence SDPA where the model's attention can be swapped, else a
    dense block-diagonal mask."""
    if "flash" in attention_implementation(model.config):
        return "varlen"
    return "packed" if supports_packed_attention(model) else "mask"


class Packer:
    """Cuts a list of samples into packed micro-batches of at most `max_tokens` tokens.

    Also carries how their decoder forward runs (`amp_dtype`, see `completion_hidden`), so the
    training, old-policy and reference passes run it alike; routing_replay: micro-batches given the engine's
    routing records route their completion tokens by them (else only compare: models/routing.py).
    """

    def __init__(self, model, max_tokens: int, amp_dtype: Optional[torch.dtype] = None, routing_replay: bool = False):
        self.model = model
        self.max_tokens = max_tokens
        self.attention: Optional[str] = None  # None: attention_mode(model) at each call
        self.device = next(model.parameters()).device
        self.amp_dtype = amp_dtype
        self.routing_replay = routing_replay

    def micro_batches(self, prompt_ids, completion_ids, include: Optional[Sequence[bool]] = None, routed_experts=None,
                      kept=None, images=None):
        """Yield PackedMicroBatch over samples with a completion (and `include[i]` when given); with the engine's
        routing records (`Rollouts.routed_experts`), each carries its `routing.Replay`; with kept sets
        (`Rollouts.kept`, truncated sampling), its `objective.KeptSets`; with a VLM's images (`Rollouts.images`: each
        sample's prompt's processor outputs, shared by a group, or None), its `vision.RowImages`, a group kept in one
        micro-batch where it fits (`plan_group_micro_batches`)."""
        lengths = [
            0 if (include is not None and not include[i]) or not completion_ids[i]
            else len(prompt_ids[i]) + len(completion_ids[i]) - 1
            for i in range(len(prompt_ids))
        ]
        attention = self.attention or attention_mode(self.model)  # checkpointing may be switched on later
        keys = self._image_keys(prompt_ids, completion_ids, images, [i for i, n in enumerate(lengths) if n > 0])
        plan = plan_micro_batches(lengths, self.max_tokens) if keys is None else \
            plan_group_micro_batches(lengths, keys, self.max_tokens)
        for rows in plan:
            mb = pack_sequences(prompt_ids, completion_ids, rows, device=self.device, attention=attention)
            if keys is not None:
                mb.images = vision.RowImages.of(mb, prompt_ids, completion_ids, images, keys,
                                                decoder_of(causal_lm_of(self.model)))
            if routed_experts is not None:
                mb.routing = routing.Replay.of(mb, routed_experts, replay=self.routing_replay)
            if kept is not None:
                mb.kept = truncation.pack(kept, mb.rows, mb.target_ids.shape[1], device=self.device)
            yield mb

    def _image_keys(self, prompt_ids, completion_ids, images, samples) -> Optional[list]:
        """Each sample's group key among the samples with images (`vision.group_keys`); None: no images at all.
        Images for a model the fused path cannot train on them, and a VLM's placeholders without their images
        (`vision.check_placeholders`: over the packed `samples`), are refused here, before any forward."""
        config = causal_lm_of(self.model).config
        if images is not None and len(images) != len(prompt_ids):
            raise ValueError(f"images: expected one entry per sample ({len(prompt_ids)}), got {len(images)}")
        if vision.supports_images(config):
            vision.check_placeholders(prompt_ids, completion_ids, images, vision.image_token_id(config), samples)
        if images is None or all(x is None for x in images):
            return None
        vision.check_images_supported(config, "the policy")
        return vision.group_keys(prompt_ids, images)


@torch.no_grad()
def completion_logprobs(model, packer: Packer, prompt_ids, completion_ids, *, temperature: float, backend: str,
                        routed_experts=None, kept=None, images=None) -> list[torch.Tensor]:
    """Per-sample log-probs `[C_i]` (float32, CPU) of the completion tokens under `model`, no grad.

    Used for the old-policy and reference passes: hidden states, then the fused linear op, so no
    logits tensor exists here either. Samples with an empty completion get an empty tensor. The
    log-probs are of the model's own logit map (its scale and soft-cap, then `temperature`).
    routed_experts: the engine's routing records (routing replay: `Packer.routing_replay`). kept: each completion's
    kept sets (truncated sampling: `Rollouts.kept`), the support of its log-softmax. images: a VLM's
    (`Rollouts.images`), each prompt's encoded once per micro-batch.
    """
    base, weight, bias = policy_parts(model)
    logit_map = logit_transform(causal_lm_of(model).config)
    out = [torch.zeros(0) for _ in prompt_ids]
    for mb in _without_dropout(model, packer.micro_batches(prompt_ids, completion_ids, routed_experts=routed_experts,
                                                           kept=kept, images=images)):
        with routing.replaying(base, mb.routing):
            hidden = completion_hidden(base, mb, packer.amp_dtype)
        logp = masked_linear_logprobs(hidden, weight, mb.target_ids, mb.completion_mask, bias=bias,
                                      temperature=temperature, **logit_map, backend=backend,
                                      **({"kept": mb.kept} if mb.kept is not None else {}))
        for i, values in zip(mb.rows, mb.unpad(logp), strict=True):
            out[i] = values.cpu()
    return out


def _without_dropout(model, items):
    """Iterate `items` with the model's dropout layers in eval mode: the no-grad passes (old policy,
    reference, sync probe) see the policy the engine samples, whatever lora_dropout the training forward
    uses (every other dropout is already 0: models.policy.prepare_policy)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    for m in layers:
        m.eval()
    try:
        yield from items
    finally:
        for m in layers:
            m.train()

"""The TRL backend on a vision-language model (issue 51): TRL's own VLM GRPO path, the fused loss in place of its logits.

A tiny Qwen2-VL (M-RoPE; tests/tiny_vlm.py) with TRL's format (a conversational prompt with an image part, an `image`
column of PIL images) and grpo_fast's PIL processor (the Qwen-VL processor classes cannot be built beside this CPU
torch: grpo_fast/data/vision.py). Stock trl.GRPOTrainer and FastGRPOTrainer train two optimizer steps from the same
weights and seed (beta > 0: the reference pass; num_iterations 2: the second step's ratios move away from 1) and log
the same metrics, within the text parity test's tolerance (tests/integrations/test_trl.py); the log-prob pass over
row chunks that cut through prompts' images gives TRL's log-probs and entropies.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, scaled
from tests.tiny_vlm import image, tiny_vlm_dir

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

# what differs between two runs of one trainer too: wall-clock times and rates
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def vowel_reward(completions, **kwargs):
    """Deterministic and spread within a group: vowels score, length a little."""
    texts = [c[0]["content"] for c in completions]
    return [float(sum(t.count(ch) for ch in "aeiou") + 0.05 * len(t)) for t in texts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from datasets import Dataset

    from grpo_fast.data.vision import load_processor

    from .conftest import grpo_config

    path = tiny_vlm_dir("qwen2_vl")
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
             "image": image(56 + 28 * (i % 2), 56, seed=i)} for i, text in enumerate(["ab", "cde", "fgh i", "jk"])]
    dataset = Dataset.from_list(rows)
    trainers = {}
    for cls in (GRPOTrainer, FastGRPOTrainer):
        processor = load_processor(path)
        processor.tokenizer.padding_side = "left"
        args = grpo_config(tmp_path_factory.mktemp(cls.__name__), beta=0.1, num_iterations=2, max_steps=2,
                           learning_rate=1e-3, shuffle_dataset=False)
        trainer = cls(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                      processing_class=processor)
        assert trainer._is_vlm
        trainer.train()
        trainers[cls] = trainer
    return trainers[GRPOTrainer], trainers[FastGRPOTrainer]


def test_a_vlm_run_logs_the_same_metrics_as_stock_trl(runs):
    stock, fast = runs
    assert type(fast).__name__ == "FastGRPOTrainer" and len(stock.state.log_history) == len(fast.state.log_history) == 3
    for step, (logged_s, logged_f) in enumerate(zip(stock.state.log_history, fast.state.log_history, strict=True)):
        assert logged_s.keys() == logged_f.keys(), f"step {step}: the trainers logged different metrics"
        for key, value in logged_s.items():
            if key not in TIMING:
                assert_close(logged_f[key], value, atol=1e-5, rtol=1e-5, name=f"step {step} {key}")
    first = stock.state.log_history[0]
    assert first["kl"] == 0 and stock.state.log_history[1]["kl"] > 0  # (the reference pass ran; the policy moved)
    assert stock.state.log_history[1]["clip_ratio/region_mean"] >= 0


def test_log_prob_pass_over_chunks_cutting_through_images_matches_trl(runs):
    stock, fast = runs
    # one micro-batch: 2 prompts x 4 completions (TRL shuffles the rows), each row its prompt's image (TRL repeats a
    # prompt's images per row); the two prompts' images differ in patches, so a chunk given another row's patches fails
    inputs = stock._buffered_inputs[0]
    assert inputs["image_grid_thw"].shape[0] == len(inputs["num_images"]) == 8
    assert inputs["image_grid_thw"].prod(-1).unique().tolist() == [16, 24]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].size(1)
    images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
    with torch.no_grad():  # both on stock's model: row chunks of 3 cut through the second prompt's group
        lp_s, ent_s, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, att, T, batch_size=3,
                                                                  compute_entropy=True, **images)
        lp_f, ent_f, _ = fast._get_per_token_logps_and_entropies(stock.model, ids, att, T, batch_size=3,
                                                                 compute_entropy=True, **images)
    assert_close(lp_f, lp_s, atol=scaled(2e-5, lp_s), name="logps")
    assert_close(ent_f, ent_s, atol=scaled(2e-5, ent_s), name="entropies")

"""TRL's vision-language GRPO tests (its TestGRPOTrainerVLM) on local stand-ins, stock and through the backend.

    python -m benchmarks.trl_suite.vlm --trl /tmp/trl-src          # both modes -> benchmarks/results/trl_suite_vlm/

What it adds to the text harness (run.py, plugin.py, standins.py; README.md): stand-ins of TRL's tiny VLMs, built
into the same hub-layout cache, of the same architectures and at the sizes of TRL's own generation scripts
(scripts/generate_tiny_models/for_conditional_generation: text hidden 16, 4 heads, 2 KV heads, 2 layers; vision
width 16, 4 heads, depth 2; bf16), on the text stand-ins' tokenizer (Qwen's vocabulary, the vision tokens at their
Qwen ids) with Qwen2-VL's chat template; TRL's zen-image and zen-multi-image datasets (the 19 Zen questions, random
32-64 px images as TRL's scripts make them). It sets TRL_SUITE_VLM=1, so the plugin keeps the VLM tests (`-k
TestGRPOTrainerVLM` selects them) and registers grpo_fast's PIL Qwen-VL processor classes with AutoProcessor: the
transformers Qwen-VL processor classes cannot be built beside this CPU torch (their video processor imports
torchvision: grpo_fast/data/vision.py), so without it neither stock TRL nor the backend can load the processor.

Which of TRL's VLM models are built (`VLM_MODELS`): Qwen2-VL and Qwen2.5-VL. Not built, so their tests fail alike in
both modes (the report says which): Gemma 3, Gemma 4, LLaVA-Next, Qwen3.5 and Qwen3.5-MoE (their processors need
their own tokenizers' special tokens, which the shared stand-in tokenizer lacks; not done).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import standins

# Qwen2-VL's chat template (system turn by default, image parts as the vision placeholder), as its processor ships it
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != "
    "'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] "
    "}}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in "
    "message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set "
    "image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% "
    "endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
            vocab_size=standins.VOCAB_SIZE, bos_token_id=standins.BOS_ID, eos_token_id=standins.EOS_ID,
            pad_token_id=standins.PAD_ID, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                           "mrope_section": [1, 1]})
# repo -> (model_type, class, vision config fields): TRL's generate_tiny_models scripts' sizes
VLM_MODELS = {
    "tiny-Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration",
                                             dict(hidden_size=16, num_heads=4, embed_dim=64, depth=2)),
    "tiny-Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
                                                dict(hidden_size=16, num_heads=4, depth=2, fullatt_block_indexes=[1],
                                                     out_hidden_size=16, intermediate_size=32)),
}
ZEN_QUESTIONS = [
    "What is better than ugly?", "What is better than implicit?", "What is better than complex?",
    "What is better than complicated?", "What is better than nested?", "What is better than dense?", "What counts?",
    "Are special cases enough to break the rules?", "What beats purity?", "What should never pass silently?",
    "When can errors pass silently?", "What should you do in the face of ambiguity?",
    "How many ways should there be to do it?", "For whom may the way not be obvious at first?",
    "What is better than never?", "Is never better than *right* now?",
    "What does it mean if the implementation is hard to explain?",
    "What does it mean if the implementation is easy to explain?", "Any great ideas?",
]
# zen-multi-image's images per prompt and where they sit (TRL's script: 0 to 3, before, between or after the text)
MULTI_IMAGE_PARTS = ["it", "ti", "iti", "iit", "it", "ti", "iti", "t", "tii", "iiti", "it", "ti", "itii", "t", "ti",
                     "tit", "it", "ti", "t"]


def build_model(repo: str, folder: Path, tokenizer) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig, Qwen2VLImageProcessorPil

    from grpo_fast.data.vision import pil_qwen_processor

    model_type, class_name, vision = VLM_MODELS[repo]
    config = AutoConfig.for_model(model_type, text_config=dict(TEXT), vision_config=vision,
                                  image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                                  video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
                                  vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
                                  vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    model = getattr(transformers, class_name)(config)
    standins._init_tiny(model)
    model.to(torch.bfloat16).save_pretrained(folder)
    GenerationConfig(bos_token_id=standins.BOS_ID, eos_token_id=standins.EOS_ID,
                     pad_token_id=standins.PAD_ID).save_pretrained(folder)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    processor = pil_qwen_processor(model_type, Qwen2VLImageProcessorPil(), tokenizer, QWEN2_VL_TEMPLATE)
    processor.save_pretrained(folder)  # (processor_config.json names the PIL class: registered by the plugin)


def build_datasets(cache: Path) -> None:
    import numpy as np
    from datasets import Dataset, DatasetDict, Features, Image, List, Value

    rng = np.random.default_rng(0)

    def picture():
        h, w = rng.integers(32, 64, size=2)
        return rng.uniform(0, 255, size=(h, w, 3)).astype(np.uint8)

    def split(data, features):
        whole = Dataset.from_dict(data, features=features)
        return DatasetDict(train=whole.select(range(17)), test=whole.select(range(17, len(whole))))

    message = [{"content": Value("string"), "role": Value("string")}]
    split({"prompt": [[{"role": "user", "content": q}] for q in ZEN_QUESTIONS],
           "image": [picture() for _ in ZEN_QUESTIONS]}, Features(prompt=message, image=Image())
          ).save_to_disk(str(standins.dataset_folder(cache, "zen-image", "conversational_prompt_only")))
    parts_message = List({"content": List({"text": Value("string"), "type": Value("string")}), "role": Value("string")})
    prompts, images = [], []
    for question, layout in zip(ZEN_QUESTIONS, MULTI_IMAGE_PARTS, strict=True):
        parts = [{"type": "text", "text": question} if p == "t" else {"type": "image", "text": None} for p in layout]
        prompts.append([{"role": "user", "content": parts}])
        images.append([picture() for p in layout if p == "i"])
    split({"prompt": prompts, "images": images}, Features(prompt=parts_message, images=List(Image()))
          ).save_to_disk(str(standins.dataset_folder(cache, "zen-multi-image", "conversational_prompt_only")))


def build(cache_root: Path) -> Path:
    """The text stand-ins (standins.build) and the VLM ones beside them, once; returns the cache folder."""
    cache = standins.build(cache_root)
    done = cache / "vlm_complete"
    if done.exists():
        return cache
    tokenizer = standins.build_tokenizer()
    for repo in VLM_MODELS:
        folder = standins.snapshot(cache, repo)
        if folder.exists():
            import shutil

            shutil.rmtree(standins.hub_folder(cache, repo))
        folder.mkdir(parents=True)
        build_model(repo, folder, tokenizer)
        (standins.hub_folder(cache, repo) / "refs").mkdir()
        (standins.hub_folder(cache, repo) / "refs" / "main").write_text(standins.COMMIT)
    build_datasets(cache)
    done.write_text(json.dumps(sorted(VLM_MODELS)) + "\n")
    return cache


def register_processors() -> None:
    """grpo_fast's PIL Qwen-VL processor classes (images only) as AutoProcessor's for their configs: the stand-ins'
    processor_config.json names them, and AutoProcessor finds a registered class by its name. Also loads the VLM
    stand-ins' modeling modules, so the plugin's per-test snapshot of them (Liger's patching undone) holds them."""
    import transformers
    from transformers import AutoConfig, AutoProcessor

    for _, class_name, _ in VLM_MODELS.values():
        getattr(transformers, class_name)

    from grpo_fast.data.vision import QWEN_VL_PROCESSORS, _images_only

    for model_type, base in QWEN_VL_PROCESSORS.items():
        try:
            config_class = type(AutoConfig.for_model(model_type))
        except (ValueError, KeyError):
            continue
        AutoProcessor.register(config_class, _images_only(base), exist_ok=True)


def main(argv=None) -> None:
    """run.py's two modes on the VLM tests, into --out, and compare.py's report into --md (not the text suite's)."""
    import argparse
    import shlex
    import shutil
    import sys
    import tempfile
    import time

    from . import compare, run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl", type=Path, required=True, help="a TRL checkout (or its tests/test_grpo_trainer.py)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "grpo_fast" / "trl_suite")
    parser.add_argument("--out", type=Path, default=run.REPO / "benchmarks" / "results" / "trl_suite_vlm")
    parser.add_argument("--md", type=Path, default=run.REPO / "benchmarks" / "results" / "trl_suite_vlm" / "trl_suite.md")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test (pytest-timeout)")
    args, rest = parser.parse_known_args(argv)
    cache = build(args.cache)
    os.environ["TRL_SUITE_VLM"] = "1"  # (the plugin keeps the VLM tests and registers the processors)
    rest = [*rest, *([] if "-k" in rest else ["-k", "TestGRPOTrainerVLM"])]
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="trl_suite_vlm_"))
    try:
        tests = scratch / "tests"
        shutil.copytree(run.trl_tests(args.trl), tests, ignore=shutil.ignore_patterns("__pycache__"))
        for mode in compare.MODES:
            code, seconds = run.run_mode(mode, tests, cache, args.out, args.timeout, rest)
            record = dict(command=shlex.join(["python", "-m", "benchmarks.trl_suite.vlm", *(argv or sys.argv[1:])]),
                          trl_checkout=str(args.trl), trl_commit=run._commit(args.trl), installed=run._versions(),
                          pytest_exit=code, seconds=seconds, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
            (args.out / f"trl_suite_{mode}_run.json").write_text(json.dumps(record, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    compare.main(["--out", str(args.out), "--md", str(args.md)])


if __name__ == "__main__":
    main()

"""Datasets with images (issue 51): TRL's format read, encoded with a tiny Qwen2-VL's processor, bad rows refused.

- A JSONL dataset with image paths (relative to the file) encodes like the same rows with PIL images, bytes and HF
  datasets' {"bytes", "path"} dicts: each image's `<|image_pad|>` repeated grid_thw.prod() / merge_size**2 times
  (counted from the PIL image processor itself), one placeholder per image before expansion (what vLLM takes).
- A prompt of plain strings gets its images before the first user text (TRL's rule).
- Bad rows are refused before any work in one line naming them and why (a missing file, a file that is not an image,
  an image over PIL's pixel limit, an image the processor refuses, image parts that do not match the images, a
  prompt over max_prompt_length once expanded), or dropped and counted with bad_images='skip'.
- The trainer's build refuses what cannot take images, by name.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from grpo_fast.data import load_dataset_rows
from grpo_fast.data.images import encode_image_prompts, image_base_dir, multimodal_messages
from grpo_fast.data.inputs import InputOptions, encode_with_images
from tests.tiny_vlm import image, tiny_vlm_dir


@pytest.fixture(scope="module")
def processor():
    from grpo_fast.data.vision import load_processor

    return load_processor(tiny_vlm_dir("qwen2_vl"))


def question(n_images: int, text: str = "What is here?") -> list:
    return [{"role": "user", "content": [*[{"type": "image"}] * n_images, {"type": "text", "text": text}]}]


def image_tokens(processor, images) -> list[int]:
    """Each image's token count from the image processor's own grid: grid_thw.prod() / merge_size**2."""
    grid = processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    return (grid.prod(-1) // processor.image_processor.merge_size ** 2).tolist()


def runs(ids, token) -> list[int]:
    """Lengths of the runs of `token` in ids."""
    out, run = [], 0
    for t in [*ids, None]:
        if t == token:
            run += 1
        elif run:
            out, run = [*out, run], 0
    return out


def test_jsonl_with_image_paths_encodes_like_pil_bytes_and_dicts(tmp_path, processor):
    pictures = [image(56, 56, seed=1), image(84, 56, seed=2), image(56, 112, seed=3)]
    (tmp_path / "imgs").mkdir()
    for k, picture in enumerate(pictures):
        picture.save(tmp_path / "imgs" / f"{k}.png")
    lines = [{"prompt": question(1), "image": "imgs/0.png"}, {"prompt": question(2), "images": ["imgs/1.png", "imgs/2.png"]}]
    # (one dataset holds one image column: two files here)
    (tmp_path / "one.jsonl").write_text(json.dumps(lines[0]) + "\n")
    (tmp_path / "two.jsonl").write_text(json.dumps(lines[1]) + "\n")
    pad = processor.image_token_id

    def png(picture):
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        return buffer.getvalue()

    for name, given in (("one", pictures[:1]), ("two", pictures[1:])):
        path = tmp_path / f"{name}.jsonl"
        rows = load_dataset_rows(path)
        ids, prompts, kept = encode_image_prompts(rows, processor, base_dir=image_base_dir(str(path)))
        assert kept == [0] and runs(ids[0], pad) == image_tokens(processor, given)
        assert runs(prompts[0].placeholder_ids, pad) == [1] * len(given)  # one placeholder an image, before expansion
        expected = processor.image_processor(images=given, return_tensors="pt")
        inputs = prompts[0].process()
        assert sorted(inputs) == ["image_grid_thw", "pixel_values"]
        assert (inputs["pixel_values"] == expected["pixel_values"]).all()
        column = "image" if name == "one" else "images"
        for form in (lambda p: p, png, lambda p: {"bytes": png(p), "path": None}):
            value = form(given[0]) if column == "image" else [form(p) for p in given]
            same, _, _ = encode_image_prompts([{"prompt": rows[0]["prompt"], column: value}], processor)
            assert same == ids


def test_plain_string_prompt_gets_its_images_before_the_first_user_text(processor):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is here?"}]
    messages = multimodal_messages(prompt, 2)
    assert messages[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is here?"}]
    (ids,), _, _ = encode_image_prompts([{"prompt": prompt, "images": [image(), image(seed=1)]}], processor)
    (marked,), _, _ = encode_image_prompts([{"prompt": [prompt[0], {"role": "user", "content": messages[1]["content"]}],
                                             "images": [image(), image(seed=1)]}], processor)
    assert ids == marked


@pytest.fixture
def bad_rows(tmp_path, monkeypatch):
    from PIL import Image

    (tmp_path / "text.png").write_text("not an image")
    image(56, 56).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # (PIL refuses more than twice this: the 56 x 56 file)
    return [
        {"prompt": question(1), "images": [image()]},                    # 0 fine
        {"prompt": question(1), "images": ["missing.png"]},              # 1 no such file
        {"prompt": question(1), "images": ["text.png"]},                 # 2 not an image
        {"prompt": question(1), "images": ["big.png"]},                  # 3 over PIL's pixel limit
        {"prompt": question(2), "images": [image()]},                    # 4 two image parts, one image
        {"prompt": question(1), "images": [image(2, 450)]},              # 5 the processor refuses (aspect ratio > 200)
        {"prompt": question(1, "x" * 400), "images": [image()]},         # 6 over max_prompt_length once expanded
    ]


def test_bad_rows_are_refused_naming_them(bad_rows, tmp_path, processor):
    with pytest.raises(ValueError) as err:
        encode_image_prompts(bad_rows, processor, base_dir=str(tmp_path), max_prompt_length=300)
    message = str(err.value)
    assert "\n" not in message and "6 of 7 rows have bad images" in message
    for expected in ("row 1: image 0: no such image file", "row 2: image 0: not a readable image",
                     "row 3: image 0: too large to open", "row 4: its prompt has 2 image part(s) but 1 image(s)",
                     "row 5: the processor refused its images", "(and 1 more rows)"):
        assert expected in message, message
    with pytest.raises(ValueError, match=r"row 0: \d+ prompt tokens with its images expanded > max_prompt_length=10"):
        encode_image_prompts(bad_rows[:1], processor, max_prompt_length=10)


def test_bad_rows_are_skipped_and_counted(bad_rows, tmp_path, processor, caplog):
    ids, prompts, kept = encode_image_prompts(bad_rows, processor, base_dir=str(tmp_path), max_prompt_length=300,
                                              bad_images="skip")
    assert kept == [0] and len(ids) == len(prompts) == 1
    assert "dropped 6 of 7 rows with bad images" in caplog.text and "row 6:" not in caplog.text  # (5 named)


def test_the_build_refuses_what_cannot_take_images(processor):
    from transformers import LlamaConfig

    rows = [{"prompt": question(1), "image": image()}]
    vlm = SimpleNamespace(config=SimpleNamespace(vision_config=object(), model_type="qwen2_vl"), name_or_path=None)
    refusals = {
        "is not a vision-language model": (dict(), SimpleNamespace(config=LlamaConfig(), name_or_path=None)),
        "max_staleness=1 .partial rollouts. is not supported with images": (dict(max_staleness=1), vlm),
        "rollout_mode='multi_answer' takes text prompts only": (dict(rollout_mode="multi_answer"), vlm),
        "held-out rows with images": (dict(eval_rows=rows), vlm),
        "both an 'image' and an 'images' column": (dict(rows=[{"prompt": question(1), "image": 1, "images": [1]}]), vlm),
    }
    for message, (given, model) in refusals.items():
        eval_rows, data = given.pop("eval_rows", None), given.pop("rows", rows)
        with pytest.raises(ValueError, match=message):
            encode_with_images(data, processor.tokenizer, InputOptions(**given), None, model, eval_rows=eval_rows)

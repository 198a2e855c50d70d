"""Checkpoints are checked as they load: a file that does not match the manifest written with it is
passed over for the previous intact checkpoint with one warning, or refused in one line naming the file;
a read that still fails names the file in one line; a checkpoint's tensors load strictly (a LoRA adapter
of another shape is refused, not loaded in part). Unit-level: checkpoints of the tiny model written and
read in this process, no run (tests/faults/test_kill_resume.py resumes a real torn checkpoint)."""

import errno
import logging
import os

import pytest
import torch

from grpo_fast.config import GRPOConfig
from grpo_fast.models import lora
from grpo_fast.run import checkpoint
from tests.tiny_model import load_tiny_model


def _save(out, step, model, tokenizer, **kwargs):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return checkpoint.save_checkpoint(str(out), step, model=model, tokenizer=tokenizer, optimizer=optimizer,
                                      scheduler=scheduler, state={"step": step}, config={}, total_limit=None, **kwargs)


def _adapter(tiny_path, **fields):
    return lora.apply_lora(load_tiny_model(tiny_path)[0], GRPOConfig(use_peft=True, lora_r=4, engine="hf", **fields))


@pytest.fixture
def two_checkpoints(tmp_path, tiny):
    out = tmp_path / "run"
    return out, [_save(out, step, *tiny) for step in (1, 2)]


def test_a_checkpoint_carries_a_manifest_of_its_files_and_intact_ones_pass(two_checkpoints):
    out, (first, second) = two_checkpoints
    record = checkpoint.read_manifest(second)
    assert record["step"] == 2 and {"model.safetensors", checkpoint.STATE_FILE, "distributed/.metadata"} <= set(record["files"])
    assert checkpoint.damage(first) is checkpoint.damage(second) is None
    assert checkpoint.resolve_checkpoint("latest", str(out)) == second


def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_previous_with_one_warning(two_checkpoints, caplog):
    out, (first, second) = two_checkpoints
    shard = os.path.join(second, checkpoint.DCP_FOLDER, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 2)
    with caplog.at_level(logging.WARNING, logger="grpo_fast.run.checkpoint"):
        assert checkpoint.resolve_checkpoint("latest", str(out)) == first
        assert checkpoint.resolve_checkpoint("latest", str(out)) == first  # (the CLI and the trainer both resolve it)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and len(warned[0].splitlines()) == 1, warned
    assert "checkpoint-2 is damaged" in warned[0] and "__0_0.distcp" in warned[0] and first in warned[0], warned
    # named explicitly, it is refused in one line naming the file
    with pytest.raises(ValueError, match=r"checkpoint-2'? is damaged: .*__0_0.distcp holds \d+ bytes where \d+ were written"):
        checkpoint.resolve_checkpoint(second, str(out))
    # and with every checkpoint damaged, 'latest' is refused (not a silent restart from step 0)
    os.truncate(os.path.join(first, checkpoint.STATE_FILE), 10)
    with pytest.raises(ValueError, match=r"no intact checkpoint in .*checkpoint-2 is damaged.*checkpoint-1 is damaged .*"
                                         r"trainer_state.pt holds 10 bytes"):
        checkpoint.resolve_checkpoint("latest", str(out))


def test_damage_that_keeps_the_size_is_named_in_one_line_when_it_loads(two_checkpoints, tiny_path):
    _, (_, second) = two_checkpoints
    for name in (checkpoint.STATE_FILE, os.path.join(checkpoint.DCP_FOLDER, "__0_0.distcp")):
        path = os.path.join(second, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(b"\0" * size)  # zeros over the whole file: the size is the manifest's, the contents are not
    assert checkpoint.damage(second) is None
    with pytest.raises(ValueError, match=r"trainer_state.pt cannot be read \(.*\): the checkpoint is damaged") as err:
        checkpoint.load_trainer_state(second)
    assert len(str(err.value).splitlines()) == 1
    model = load_tiny_model(tiny_path)[0]
    with pytest.raises(ValueError, match=r"distributed cannot be read \(.*\): the checkpoint is damaged") as err:
        checkpoint.load_sharded(model, torch.optim.AdamW(model.parameters()), os.path.join(second, checkpoint.DCP_FOLDER))
    assert len(str(err.value).splitlines()) == 1, str(err.value)


def test_a_lora_checkpoint_loads_strictly_into_an_adapter_of_another_shape(tmp_path, tiny_path):
    """Saved on every linear layer (28 tensors), loaded into a q_proj-only adapter: refused, where it loaded the 4
    common tensors and dropped 24 silently."""
    saved = _adapter(tiny_path)
    folder = str(tmp_path / "dcp")
    checkpoint.save_sharded(saved, torch.optim.AdamW([p for p in saved.parameters() if p.requires_grad]), folder)
    other = _adapter(tiny_path, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"does not hold this model's tensors: 0 of the model's \d+ are not in it .* "
                                         r"24 of its \d+ are not in the model .*lora_target_modules") as err:
        checkpoint.load_sharded(other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]), folder)
    assert len(str(err.value).splitlines()) == 1
    same = _adapter(tiny_path)
    checkpoint.load_sharded(same, torch.optim.AdamW([p for p in same.parameters() if p.requires_grad]), folder)


def test_a_full_disk_names_the_size_of_a_lora_checkpoint(tmp_path, tiny_path, monkeypatch):
    """A LoRA checkpoint is kilobytes here: the message gave "needs about 0 MiB"."""
    model = _adapter(tiny_path)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    real_save = checkpoint.torch.save

    def full(obj, path, *args, **kwargs):
        if str(path).endswith(checkpoint.STATE_FILE):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(OSError, match=r"writing checkpoint-1 needs about (\d+) KiB") as err:
        _save(tmp_path / "run", 1, model, None)
    needed = int(str(err.value).split("needs about ")[1].split(" KiB")[0])
    # the adapter's file, its sharded copy and AdamW's two moments
    assert needed == round(4 * adapter_bytes / 1024) > 0, (needed, adapter_bytes)


def test_final_written_knows_the_step_and_merged(tmp_path, tiny):
    from grpo_fast.distributed import ONE_PROCESS, Parallel

    model, tokenizer = tiny
    final = str(tmp_path / "final")
    assert not checkpoint.final_written(final, 2, merged=False)
    checkpoint.save_final_model(final, model, tokenizer, Parallel(model, ONE_PROCESS), step=2)
    assert checkpoint.final_written(final, 2, merged=False)
    assert not checkpoint.final_written(final, 3, merged=False), "final/ of an earlier step is not this step's"
    assert not checkpoint.final_written(final, 2, merged=True), "merged/ asked for, not written"
    os.truncate(os.path.join(final, "model.safetensors"), 100)
    assert not checkpoint.final_written(final, 2, merged=False), "a damaged final/ is written again"

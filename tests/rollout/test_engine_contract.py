"""The engine contract and the vLLM compatibility module: an engine lacking a contract member is refused by
name before any work; only generation/engines/vllm_compat.py reaches vLLM's internals; a vLLM outside the tested range
is refused in one line (or, with GRPO_FAST_ALLOW_UNTESTED_VLLM=1, warned about)."""

import ast
from pathlib import Path

import pytest

from grpo_fast.generation.engines import vllm_compat
from grpo_fast.generation.engines.base import ENGINE_CONTRACT, check_engine

PACKAGE = Path(__file__).resolve().parents[2] / "grpo_fast"
COMPAT = PACKAGE / "generation" / "engines" / "vllm_compat.py"
# vLLM's public API: what any module may import
PUBLIC = {"vllm": {"LLM", "SamplingParams"}, "vllm.inputs": {"TokensPrompt", "TextPrompt"},
          "vllm.lora.request": {"LoRARequest"}}
# attributes on the way to vLLM's internals
INTERNAL_ATTRIBUTES = ("llm_engine", "driver_worker", "model_runner", "parallel_state", "engine_core")


def _vllm_imports(path: Path) -> list[str]:
    """'module: names' of every vLLM import in `path` that is not the public API."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names = {alias.name for alias in node.names}
            if not names <= PUBLIC.get(node.module, set()):
                found.append(f"{node.module}: {sorted(names)}")
    return found


def test_only_the_compat_module_reaches_vllm_internals():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        text = path.read_text()
        bad = _vllm_imports(path) + [f".{a}" for a in INTERNAL_ATTRIBUTES if f".{a}" in text]
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, f"vLLM internals outside generation/engines/vllm_compat.py: {offenders}"
    assert _vllm_imports(COMPAT), "the compat module is where the internals are (the scan must see them)"


def test_a_vllm_outside_the_tested_range_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv(vllm_compat.ALLOW_UNTESTED, raising=False)
    vllm_compat.check_version("0.32.0")
    vllm_compat.check_version("0.32.3+cpu")
    for version in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"vLLM {version} is outside .*>=0.32,<0.33.*GRPO_FAST_ALLOW_UNTESTED_VLLM=1") as err:
            vllm_compat.check_version(version)
        assert "\n" not in str(err.value)
    monkeypatch.setenv(vllm_compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=r"vLLM 0.33.0 is outside .*running anyway"):
        vllm_compat.check_version("0.33.0")


def test_the_installed_vllm_is_in_the_tested_range():
    pytest.importorskip("vllm")
    vllm_compat.check_version()  # what CI installs (setup_env.sh) must pass its own check


class _FullEngine:
    """Every contract member, nothing else."""

    vocab_size = 320
    max_model_len = 64
    runs_partial_rollouts = False
    streams_groups = False

    @property
    def dtype(self):
        import torch

        return torch.float32

    def shares_weights_with(self, model):
        return False

    def generate(self, *args, **kwargs):
        raise AssertionError("not called in this test")

    update_weights = update_adapter = prompt_logprobs = reset_prefix_cache = sleep = wake = generate


def test_the_contract_is_checked_and_names_what_is_missing():
    check_engine(_FullEngine())
    for member in ENGINE_CONTRACT:
        with pytest.raises(ValueError, match=rf"engine Partial lacks \['{member}'\] of the engine contract"):
            check_engine(_without(member))


def _without(member: str):
    """An engine with every contract member but `member`."""
    attrs = {k: v for k, v in vars(_FullEngine).items() if not k.startswith("__")}
    attrs.pop(member)
    return type("Partial", (), attrs)()


def test_the_trainer_refuses_an_engine_lacking_a_member_before_loading(tmp_path, monkeypatch):
    from grpo_fast import models
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows, target_fraction

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(ValueError, match=r"engine Partial lacks \['dtype'\] of the engine contract"):
        GRPOTrainer(config(tmp_path, model="unused"), [target_fraction], rows(), engine=_without("dtype"))

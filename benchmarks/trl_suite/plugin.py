"""pytest plugin: TRL's tests/test_grpo_trainer.py on local stand-ins, with stock TRL or grpo_fast's backend.

Loaded by run.py (`-p benchmarks.trl_suite.plugin`), which sets the environment it reads:
  TRL_SUITE_MODE   "stock" (trl.GRPOTrainer as installed) or "backend" (trl.GRPOTrainer is grpo_fast's
                   FastGRPOTrainer: the name the test file imports from trl is replaced before it is imported)
  TRL_SUITE_CACHE  the stand-ins folder (standins.build); HF_HUB_CACHE must be its hub/ and HF_HUB_OFFLINE=1,
                   so the hub model ids resolve to the stand-in models with no patch of any loader
  TRL_SUITE_LOGS   where to write, per test, what each trainer logged: its class, state.log_history, and
                   the first optimizer step's metrics (means of TRL's `_metrics` lists, as TRL's log reduces
                   them) and losses, so stock and backend can be compared at step 1 whatever logging_steps is

`datasets.load_dataset` is replaced: ids under trl-internal-testing/ load the stand-ins (splits, configs and
streaming as asked), any other id goes to the real function (which cannot reach the hub here). Tests that load
a vision-language model or an image dataset are deselected (the vision-language issue's, not this suite's), unless
TRL_SUITE_VLM=1 (vlm.py: its stand-ins built, grpo_fast's PIL Qwen-VL processors registered with AutoProcessor).
The snapshot's helpers may import `is_<package>_available` checks the installed TRL lacks: those are supplied.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

VLM_MARKERS = ("ConditionalGeneration", "zen-image", "zen-multi-image")
TIMING = ("time", "runtime", "per_second", "flos")  # metric names that measure time, not the model

_records: dict[str, list] = defaultdict(list)
_current = {"test": None}


def _settings():
    mode = os.environ.get("TRL_SUITE_MODE")
    if mode not in ("stock", "backend"):
        raise pytest.UsageError(f"TRL_SUITE_MODE={mode!r}: expected 'stock' or 'backend' (run benchmarks/trl_suite/run.py)")
    cache = Path(os.environ.get("TRL_SUITE_CACHE", ""))
    if os.environ.get("HF_HUB_OFFLINE") != "1" or Path(os.environ.get("HF_HUB_CACHE", "")) != cache / "hub":
        raise pytest.UsageError("HF_HUB_OFFLINE=1 and HF_HUB_CACHE=$TRL_SUITE_CACHE/hub are required: the hub ids "
                                "must resolve to the stand-ins (run benchmarks/trl_suite/run.py)")
    return mode, cache


def _local_load_dataset(original, cache: Path):
    from datasets import IterableDatasetDict, load_from_disk

    from .standins import ORG, dataset_folder

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not str(path).startswith(f"{ORG}/"):
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        folder = dataset_folder(cache, str(path).split("/", 1)[1], name)
        if not folder.exists():
            raise ValueError(f"no local stand-in for dataset {path!r} config {name!r} (benchmarks/trl_suite/standins.py)")
        splits = load_from_disk(str(folder))
        if streaming:
            splits = IterableDatasetDict({key: value.to_iterable_dataset() for key, value in splits.items()})
        return splits if split is None else splits[split]

    return load_dataset


def _recording(GRPOTrainer):
    """Wrap the stock class's train and training_step (FastGRPOTrainer inherits both) to record, per running
    test, each trainer's log history and its first optimizer step's metrics and losses."""
    from transformers import TrainerCallback

    train, training_step = GRPOTrainer.train, GRPOTrainer.training_step

    class StepOne(TrainerCallback):
        def __init__(self, record, trainer):
            self.record, self.trainer = record, trainer

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                logged = self.trainer._metrics["train"]
                self.record["step1"] = {name: sum(values) / len(values) for name, values in logged.items()
                                        if values and not any(t in name for t in TIMING)}

    def recorded_train(self, *args, **kwargs):
        record = {"trainer": type(self).__name__, "step1": None, "step1_losses": []}
        self._trl_suite_record = record
        self.add_callback(StepOne(record, self))
        try:
            return train(self, *args, **kwargs)
        finally:
            record["log_history"] = copy.deepcopy(self.state.log_history)
            _records[_current["test"] or "?"].append(record)

    def recorded_training_step(self, *args, **kwargs):
        loss = training_step(self, *args, **kwargs)
        record = getattr(self, "_trl_suite_record", None)
        if record is not None and self.state.global_step == 0:
            record["step1_losses"].append(float(loss))
        return loss

    GRPOTrainer.train, GRPOTrainer.training_step = recorded_train, recorded_training_step


def _version_gap_shims() -> None:
    """The test file's helpers import `is_<package>_available` checks that a newer TRL added to trl.import_utils
    (is_joblib_available): each missing one answers whether the package is installed, as TRL's do."""
    import importlib
    import importlib.util

    import_utils = importlib.import_module("trl.import_utils")  # (trl is a lazy module: no attribute access)

    def missing(name):
        if name.startswith("is_") and name.endswith("_available"):
            package = name[len("is_"):-len("_available")]
            return lambda *args, **kwargs: importlib.util.find_spec(package) is not None
        raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")

    import_utils.__getattr__ = missing


def _import_modeling_modules() -> None:
    """Load the stand-ins' modeling modules now, so the per-test snapshot (`_modeling_state`) holds them before any
    test can patch them."""
    import transformers

    from .standins import MODELS

    for _, class_name, _ in MODELS.values():
        getattr(transformers, class_name, None)


def pytest_configure(config):
    mode, cache = _settings()
    import datasets
    import trl

    _version_gap_shims()
    _import_modeling_modules()

    datasets.load_dataset = _local_load_dataset(datasets.load_dataset, cache)
    if os.environ.get("TRL_SUITE_VLM") == "1":
        from .vlm import register_processors

        register_processors()
    _recording(trl.GRPOTrainer)
    if mode == "backend":
        from grpo_fast.integrations.trl import FastGRPOTrainer

        trl.GRPOTrainer = FastGRPOTrainer  # what `from trl import GRPOTrainer` in the test file now gets
    config.trl_suite_mode = mode


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRL_SUITE_VLM") == "1":  # (vlm.py: the VLM tests run)
        return

    def loads_vision(item):
        try:
            source = inspect.getsource(item.obj)
        except (OSError, TypeError):
            return False
        return "VLM" in item.nodeid or any(marker in source for marker in VLM_MARKERS)

    deselected = [item for item in items if loads_vision(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


def _modeling_state() -> dict:
    """The attributes of every loaded transformers modeling module and of the classes defined there: what Liger's
    kernel patching (use_liger_kernel=True) replaces for the whole process, not for the model it was given."""
    import sys

    state = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and module is not None:
            state[module] = dict(vars(module))
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    state[value] = dict(vars(value))
    return state


def _restore(state: dict) -> None:
    for owner, attributes in state.items():
        for key, value in attributes.items():
            if vars(owner).get(key, _restore) is not value and key not in ("__dict__", "__weakref__"):
                setattr(owner, key, value)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Record what the test trains; afterwards undo any patching of transformers' modeling modules (Liger's
    kernels replace RMSNorm, MLP and rotary classes process-wide: on a CPU, where its Triton kernels cannot run,
    every later test would fail, whichever mode)."""
    _current["test"] = item.nodeid
    state = _modeling_state()
    try:
        yield
    finally:
        _current["test"] = None
        _restore(state)


@pytest.hookimpl(trylast=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call":
        _records.setdefault(item.nodeid, [])  # a test that trained nothing still shows


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TRL_SUITE_LOGS")
    if path:
        Path(path).write_text(json.dumps({"mode": session.config.trl_suite_mode, "tests": _records}, indent=1,
                                         default=str))

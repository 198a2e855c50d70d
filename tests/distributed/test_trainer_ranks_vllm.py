"""test_trainer_ranks.py's check of 2 gloo ranks against one process with the same global batch, for FSDP2 with
one in-process vLLM engine per rank (the layer-by-layer sync into each rank's engine; closing a rank's engine
leaves the trainer's process group alive). Its own file, so that under `pytest -n 2 --dist loadfile` the two
workers run the ranks' launches side by side."""

import pytest

from tests.distributed import test_trainer_ranks as ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """The reference run for an engine: one process, 16 completions per step (test_trainer_ranks.py's fixture
    of this name, without its HF launches)."""

    def run(engine: str):
        out = tmp_path_factory.mktemp(f"one-{engine}") / "run"
        return (out, *ranks._one(tiny_model_dir, out, engine))

    return run


@pytest.mark.parametrize("strategy, engine", [("fsdp2", "vllm")])
def test_two_ranks_train_like_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir, one_process,
                                                                     strategy, engine):
    ranks.test_two_ranks_train_like_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir, one_process,
                                                                           None, strategy, engine)

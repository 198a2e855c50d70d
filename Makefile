# Shortcuts. Each target sets up .venv first (quick when already set up).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test train bench lint gpu-suite gpu-wheels
setup:
	@./scripts/setup_env.sh
test: setup
	$(VENV)/bin/ruff check grpo_fast kernels tests benchmarks
	$(PY) -m compileall -q grpo_fast tests >/dev/null  # bytecode once: where PYTHONDONTWRITEBYTECODE is set, each of the suite's ~60 processes compiled the package again (~0.3 s)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests  # two workers (the 2-core machines), one test file each at a time, the longest files first (tests/conftest.py)
train: setup
	$(VENV)/bin/grpo-fast train --overwrite_output_dir  # the default run replaces its own earlier run
bench: setup
	$(PY) benchmarks/bench_loss.py
lint: setup
	$(VENV)/bin/ruff check grpo_fast kernels tests benchmarks
gpu-suite:
	bash benchmarks/gpu_suite.sh benchmarks/results/gpu
gpu-wheels: setup  # what the GPU image lacks, to carry with a device call (benchmarks/gpu_suite.sh installs it there)
	$(PY) -m pip download bitsandbytes==0.50.2 --no-deps --only-binary :all: -d gpu_wheels

# Shortcuts. Each target sets up .venv first (quick when already set up).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test train bench lint gpu-suite
setup:
	@./scripts/setup_env.sh
test: setup
	$(VENV)/bin/ruff check grpo_fast kernels tests benchmarks
	$(PY) -m pytest -q tests
train: setup
	$(VENV)/bin/grpo-fast train --overwrite_output_dir  # the default run replaces its own earlier run
bench: setup
	$(PY) benchmarks/bench_loss.py
lint: setup
	$(VENV)/bin/ruff check grpo_fast kernels tests benchmarks
gpu-suite:
	bash benchmarks/gpu_suite.sh benchmarks/results/gpu

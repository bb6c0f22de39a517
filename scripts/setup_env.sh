#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU torch and build zero-offload in editable mode.
# Sourced by scripts/test.sh and scripts/demo.sh so both work on a fresh machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZO_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
# torch==2.13.0 is pinned: this machine carries its CPU wheel, and an unpinned torch would pull a multi-GB
# CUDA build. xxhash (checkpoint checksums) is pinned to the version the checkpoints were tested with.
# transformers is for the tests only (Hugging Face GPT-2 / Llama built from configs, no hub); lightning and
# accelerate (pinned) for the integration tests and the benchmarks against accelerate.
if ! "$py" -c "import torch, pytest, hypothesis, psutil, numpy, transformers, xxhash, lightning, accelerate" \
    >/dev/null 2>&1 \
    || ! "$venv/bin/ruff" --version >/dev/null 2>&1; then
    "$py" -m pip install -q --disable-pip-version-check \
        "torch==2.13.0" numpy psutil "xxhash==4.1.0" "pytest>=7" "hypothesis>=6" "ruff>=0.5" "clang-format>=17" \
        "transformers>=4.40" "lightning==2.6.6" "accelerate==1.15.0" \
        "setuptools>=64" wheel "pybind11>=2.12" 2>&1 | grep -v "is ignored: it is neither" || true
fi
"$py" -c "import torch" # fail here, clearly, if the install above did not work
# Editable install: rebuilds the C++ extensions in place. No build isolation: the build requirements
# (setuptools, pybind11) are already in the venv, so nothing is fetched and torch is never needed.
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e "$root" 2>&1 \
    | grep -v "is ignored: it is neither" || true
"$py" -c "import offload._aio, offload._cpu_optim" # the build must have produced both extensions

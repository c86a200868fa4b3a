#!/usr/bin/env bash
# Create .venv (if needed) and install Tidal into it, building the C++ CPU expert kernels.
# Sourced by demo.sh and test.sh; safe to run again (it only installs what is missing or stale).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# torch first and pinned: an open range would let pip pick a multi-GB CUDA wheel. A compatible torch
# already in the venv (for example a CUDA build a GPU user installed) is kept.
if ! python -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not (2, 11) <= v < (2, 15))' 2>/dev/null; then
  pip install --disable-pip-version-check -q "torch==${TIDAL_TORCH_VERSION:-2.13.0}"
fi
pip install --disable-pip-version-check -q -e ".${TIDAL_EXTRAS:-}"

#!/usr/bin/env bash
# Set up flodl on a fresh machine: torch first (if missing), then flodl with its
# test and example extras, installed editable from this checkout.
#
#   bash launch/setup.sh                 # uses python3
#   PYTHON=/path/to/python bash launch/setup.sh
#   FLODL_TORCH_SPEC="torch==2.5.1" bash launch/setup.sh   # pick your torch build
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# ---- torch ------------------------------------------------------------------
# A bare `torch` requirement can pull a multi-GB CUDA build; install a known
# build first so pip's resolver keeps it. 2.13.0 is the CPU build these
# machines carry; on a GPU box set FLODL_TORCH_SPEC to the build you want.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${FLODL_TORCH_SPEC:-torch==2.13.0}"
  "$PY" -m pip install -q "${FLODL_TORCH_SPEC:-torch==2.13.0}"
fi

# ---- flodl ------------------------------------------------------------------
"$PY" -m pip install -q -e ".[test,examples]"
echo "setup: flodl $("$PY" -c 'import flodl; print(flodl.__version__)') ready (torch $("$PY" -c 'import torch; print(torch.__version__)'))"

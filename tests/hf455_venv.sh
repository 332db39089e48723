#!/usr/bin/env bash
# Build, or reuse, the scratch virtualenv that tests/test_decoding_hf455.py runs its reference under
# (transformers 4.55.4, the last release with the v4 beam machinery, next to our torch 2.13.0).
#
#   BEAMLINE_HF455_PYTHON="$(tests/hf455_venv.sh)" python -m pytest tests/test_decoding_hf455.py
#
# Prints only the venv's python on stdout; pip's output goes to stderr. Reuses the venv when its
# python imports transformers 4.55.4 and torch 2.13.0, otherwise deletes and rebuilds it.
#   BEAMLINE_HF455_VENV         where the venv lives (default ~/.cache/beamline/hf455)
#   BEAMLINE_HF455_BASE_PYTHON  interpreter the venv is made from (default: python, else python3)
set -euo pipefail

VENV="${BEAMLINE_HF455_VENV:-$HOME/.cache/beamline/hf455}"
PY="$VENV/bin/python"
BASE_PYTHON="${BEAMLINE_HF455_BASE_PYTHON:-$(command -v python || command -v python3)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

usable() {
  [ -x "$PY" ] && "$PY" - >/dev/null 2>&1 <<'EOF'
import torch
import transformers

assert transformers.__version__ == "4.55.4", transformers.__version__
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
EOF
}

mkdir -p "$(dirname "$VENV")"
# Two CI jobs sharing a home directory must not build the same venv at once.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.lock"
  flock 9
fi

if usable; then
  echo "hf455 venv: reusing $VENV" >&2
else
  echo "hf455 venv: building $VENV from $BASE_PYTHON" >&2
  # Only ever delete a venv (or nothing): BEAMLINE_HF455_VENV might point somewhere precious.
  if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV")" ]; then
    echo "hf455 venv: $VENV exists and is not a virtualenv; not touching it" >&2
    exit 1
  fi
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  # torch first and alone: with transformers on the same line pip could resolve the CUDA build.
  "$PY" -m pip install -q torch==2.13.0 >&2
  # transformers pulls what it needs to import (numpy, tokenizers, safetensors, hub, ...).
  "$PY" -m pip install -q transformers==4.55.4 >&2
  if ! usable; then
    echo "hf455 venv: $VENV was built but cannot import transformers 4.55.4 + torch 2.13.0" >&2
    exit 1
  fi
fi

echo "$PY"

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

NAME=hf455
VENV="${BEAMLINE_HF455_VENV:-$HOME/.cache/beamline/hf455}"
BASE_PYTHON="${BEAMLINE_HF455_BASE_PYTHON:-$(command -v python || command -v python3)}"
VENV_FLAGS=""

usable() {
  [ -x "$PY" ] && "$PY" - >/dev/null 2>&1 <<'PROBE'
import torch
import transformers

assert transformers.__version__ == "4.55.4", transformers.__version__
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
PROBE
}

install() {
  # torch first and alone: with transformers on the same line pip could resolve the CUDA build.
  "$PY" -m pip install -q torch==2.13.0 >&2
  # transformers pulls what it needs to import (numpy, tokenizers, safetensors, hub, ...).
  "$PY" -m pip install -q transformers==4.55.4 >&2
}

source "$(dirname "$0")/scratch_venv.sh"
scratch_venv

#!/usr/bin/env bash
# Build, or reuse, the scratch virtualenv with Triton 3.6, the release the lent GPU machines run
# (../shared/gpu/README.md), beside this machine's torch: tests/test_triton_compile.py compiles the
# kernel offline with it too, since CI's own Triton is newer.
#
#   BEAMLINE_TRITON36_PYTHON="$(tests/triton36_venv.sh)" python -m pytest tests/test_triton_compile.py
#
# Prints only the venv's python on stdout; pip's output goes to stderr. The venv sees the system's
# packages (torch, transformers) and holds triton 3.6.0 itself; it is reused while its python
# imports that triton, else rebuilt.
#   BEAMLINE_TRITON36_VENV         where the venv lives (default ~/.cache/beamline/triton36)
#   BEAMLINE_TRITON36_BASE_PYTHON  interpreter the venv is made from (default: python, else python3)
set -euo pipefail

NAME=triton36
VENV="${BEAMLINE_TRITON36_VENV:-$HOME/.cache/beamline/triton36}"
BASE_PYTHON="${BEAMLINE_TRITON36_BASE_PYTHON:-$(command -v python || command -v python3)}"
VENV_FLAGS="--system-site-packages"

usable() {
  [ -x "$PY" ] && "$PY" - >/dev/null 2>&1 <<'PROBE'
import torch
import triton

assert triton.__version__ == "3.6.0", triton.__version__
PROBE
}

install() {
  "$PY" -m pip install -q --no-deps triton==3.6.0 >&2
}

source "$(dirname "$0")/scratch_venv.sh"
scratch_venv

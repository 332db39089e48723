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

VENV="${BEAMLINE_TRITON36_VENV:-$HOME/.cache/beamline/triton36}"
PY="$VENV/bin/python"
BASE_PYTHON="${BEAMLINE_TRITON36_BASE_PYTHON:-$(command -v python || command -v python3)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

usable() {
  [ -x "$PY" ] && "$PY" - >/dev/null 2>&1 <<'PROBE'
import torch
import triton

assert triton.__version__ == "3.6.0", triton.__version__
PROBE
}

mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null 2>&1; then  # two CI jobs sharing a home must not build it at once
  exec 9>"$VENV.lock"
  flock 9
fi

if usable; then
  echo "triton36 venv: reusing $VENV" >&2
else
  echo "triton36 venv: building $VENV from $BASE_PYTHON" >&2
  # Only ever delete a venv (or nothing): BEAMLINE_TRITON36_VENV might point somewhere precious.
  if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV")" ]; then
    echo "triton36 venv: $VENV exists and is not a virtualenv; not touching it" >&2
    exit 1
  fi
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv --system-site-packages "$VENV"
  "$PY" -m pip install -q --no-deps triton==3.6.0 >&2
  if ! usable; then
    echo "triton36 venv: $VENV was built but cannot import triton 3.6.0 beside torch" >&2
    exit 1
  fi
fi

echo "$PY"

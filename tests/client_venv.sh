#!/usr/bin/env bash
# Build, or reuse, the scratch virtualenv of one real client that tests/clients/ runs against a
# live beamline: each client is installed as its users install it (`pip install <client>` into a
# fresh venv, so its own pins decide httpx, pydantic, openai, ...), never into our environment.
#
#   BEAMLINE_GUIDELLM_PYTHON="$(bash tests/client_venv.sh guidellm)" \
#     python -m pytest tests/clients/test_guidellm.py
#
# Clients and the env var tests/clients/ reads for each (pinned releases, so CI is reproducible):
#   guidellm      guidellm==0.8.1          BEAMLINE_GUIDELLM_PYTHON      (CPU torch 2.13.0 first)
#   instructor    instructor==1.17.0       BEAMLINE_INSTRUCTOR_PYTHON    (pins openai < ours)
#   langchain     langchain-openai==1.7.4  BEAMLINE_LANGCHAIN_PYTHON
#   litellm       litellm==1.110.2         BEAMLINE_LITELLM_PYTHON
#   schemathesis  schemathesis==4.32.5     BEAMLINE_SCHEMATHESIS_PYTHON
#
# Prints only the venv's python on stdout; pip's output goes to stderr. Reuses the venv while its
# python imports the pinned release, otherwise deletes and rebuilds it.
#   BEAMLINE_CLIENT_VENVS        where the venvs live (default ~/.cache/beamline/clients/<client>)
#   BEAMLINE_CLIENT_BASE_PYTHON  interpreter the venvs are made from (default: python, else python3)
set -euo pipefail

CLIENT="${1:?usage: client_venv.sh guidellm|instructor|langchain|litellm|schemathesis}"
case "$CLIENT" in
  guidellm) DIST=guidellm VERSION=0.8.1 ;;
  instructor) DIST=instructor VERSION=1.17.0 ;;
  langchain) DIST=langchain-openai VERSION=1.7.4 ;;
  litellm) DIST=litellm VERSION=1.110.2 ;;
  schemathesis) DIST=schemathesis VERSION=4.32.5 ;;
  *)
    echo "client_venv.sh: unknown client $CLIENT" >&2
    exit 2
    ;;
esac

NAME="client-$CLIENT"
VENV="${BEAMLINE_CLIENT_VENVS:-$HOME/.cache/beamline/clients}/$CLIENT"
BASE_PYTHON="${BEAMLINE_CLIENT_BASE_PYTHON:-$(command -v python || command -v python3)}"
VENV_FLAGS=""

usable() {
  # The installed distribution's version, read from its metadata (no import: litellm's takes
  # seconds), must be the pin.
  [ -x "$PY" ] && "$PY" - "$DIST" "$VERSION" >/dev/null 2>&1 <<'PROBE'
import sys
from importlib.metadata import version

assert version(sys.argv[1]) == sys.argv[2], version(sys.argv[1])
PROBE
}

install() {
  if [ "$CLIENT" = guidellm ]; then
    # guidellm needs torch (through transformers); alone first, the CPU build this machine has,
    # else pip resolves the multi-GB CUDA one.
    "$PY" -m pip install -q torch==2.13.0 >&2
  fi
  "$PY" -m pip install -q "$DIST==$VERSION" >&2
}

source "$(dirname "$0")/scratch_venv.sh"
scratch_venv

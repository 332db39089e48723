# Sourced by tests/hf455_venv.sh and tests/triton36_venv.sh: build, or reuse, a scratch virtualenv
# that a test runs another release of a library under. The caller sets NAME (for messages), VENV
# (where it lives), BASE_PYTHON (what it is made from) and VENV_FLAGS (more `python -m venv`
# flags, may be empty), defines `usable` (exit 0 when "$PY" imports the right releases) and
# `install` (pip installs into "$PY", output to stderr), then calls `scratch_venv`, which prints
# only the venv's python on stdout. A venv that is not usable is deleted and built again.

scratch_venv() {
  PY="$VENV/bin/python"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  mkdir -p "$(dirname "$VENV")"
  # Two CI jobs sharing a home directory must not build the same venv at once.
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV.lock"
    flock 9
  fi
  if usable; then
    echo "$NAME venv: reusing $VENV" >&2
  else
    echo "$NAME venv: building $VENV from $BASE_PYTHON" >&2
    # Only ever delete a venv (or nothing): $VENV might point somewhere precious.
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV")" ]; then
      echo "$NAME venv: $VENV exists and is not a virtualenv; not touching it" >&2
      exit 1
    fi
    rm -rf "$VENV"
    # shellcheck disable=SC2086  # VENV_FLAGS: zero or more flags
    "$BASE_PYTHON" -m venv $VENV_FLAGS "$VENV"
    install
    if ! usable; then
      echo "$NAME venv: $VENV was built but does not import what it must" >&2
      exit 1
    fi
  fi
  echo "$PY"
}

#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (benchmarks/gpu_wheels.txt, then any names given as
# arguments) for CPython 3.12 on x86-64 into .whl/ at the repository root (kept out of git).
# Platforms up to manylinux_2_35 (a CUDA 13 image's glibc is newer): llguidance 1.9 ships only
# manylinux_2_31 wheels.
# Each is pinned to the version installed here when there is one: the versions the CPU tests ran
# with, which match one another (pydantic pins pydantic-core exactly; fastapi needs its starlette);
# if the index lacks that version, the newest one it has is taken, with a warning.
# There: pip install --no-index --no-deps --target /tmp/deps .whl/*.whl; PYTHONPATH=/tmp/deps:.
set -u
cd "$(dirname "$0")/.."
if [ -d .git/info ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
  echo '/.whl/' >> .git/info/exclude
fi
mkdir -p .whl
mapfile -t specs < <(python3 - "$@" <<'PY'
import importlib.metadata as md
import sys
from pathlib import Path

text = Path("benchmarks/gpu_wheels.txt").read_text()
names = [line.split("#")[0].strip() for line in text.splitlines()]
for name in [name for name in names if name] + sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
PY
)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$1" 2>&1 | grep -v "is ignored"
  return "${PIPESTATUS[0]}"
}
failed=()
for spec in "${specs[@]}"; do
  download "$spec" >/dev/null && continue
  if [ "${spec%%==*}" != "$spec" ] && download "${spec%%==*}" >/dev/null; then
    echo "warning: ${spec} is not on the index; took its newest wheel there" >&2
  else
    failed+=("$spec")
  fi
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "not downloaded: ${failed[*]}" >&2
  exit 1
fi

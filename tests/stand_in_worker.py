"""Stands in for `python -m server.compile_worker` in tests: exits with the code it reads."""

import sys

if __name__ == "__main__":
    raise SystemExit(int(sys.stdin.read()))

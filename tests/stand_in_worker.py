"""Stands in for `python -m server.compile_worker` in tests: exits with the code it reads, or is
killed by the signal a negative one names."""

import os
import sys

if __name__ == "__main__":
    code = int(sys.stdin.read())
    if code < 0:
        os.kill(os.getpid(), -code)
    raise SystemExit(code)

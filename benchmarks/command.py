"""The command line a benchmark records in its JSON: what reproduces the run, without the flags
that only say where it wrote (another machine writes elsewhere)."""

from __future__ import annotations

import shlex
from collections.abc import Collection, Sequence


def reproducing_command(module: str, argv: Sequence[str], local_flags: Collection[str]) -> str:
    """`python -m <module> <argv>` less each of `local_flags` and its value (`--flag value` or
    `--flag=value`)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in local_flags:
            skip = True
        elif arg.split("=", 1)[0] not in local_flags:
            kept.append(arg)
    return shlex.join(["python", "-m", module, *kept])

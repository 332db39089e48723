"""`python -m server.compile_worker`: a server's decode step compiled into its compile cache by a
process of its own, while the server answers with the eager step (model/background_compile.py).

Reads `runner_setup.compile_spec`'s JSON on stdin: the server's config with a KV pool of a few
blocks, the model's directory and the server's thread count (a key of the cache entry, checked by
the graphs' guards). Builds the same runner the server built and compiles its step, or loads it
when another process got there first. Exit 0: every graph is in the cache; 3: the step does not
compile ahead of time (nothing for the server to load). Ends when its server does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from server.config import ServerConfig
from server.logs import setup_logging
from server.model.background_compile import NICENESS, NICENESS_VARIABLE, NOT_AHEAD_OF_TIME
from server.runner_setup import build_runner


class _SaysWho(logging.Filter):
    """Each line this process logs begins "compile process <pid>:" (it shares the server's log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"compile process {os.getpid()}: {record.msg}"
        return True


def _end_with_parent() -> None:
    """Exit once the server that started this process is gone (its exit did not stop us)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    spec = json.loads(sys.stdin.read())
    config = ServerConfig.model_validate(spec["config"])
    setup_logging(config.log_level, config.log_format)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_SaysWho())
    _end_with_parent()
    os.nice(int(os.environ.get(NICENESS_VARIABLE, NICENESS)))  # the server's steps first

    torch.set_num_threads(int(spec["threads"]))
    runner = build_runner(config, Path(spec["model_dir"]), torch.device("cpu"))
    steps = runner.compiled_decode
    if steps is None:
        raise SystemExit("the runner compiles no decode step: nothing to do")
    runner.warm_up()
    return 0 if all(source != "jit" for source in steps.sources) else NOT_AHEAD_OF_TIME


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m benchmarks.frontend.thread_names NAMES_FILE SERVE_ARGS...`: `beamline serve` with
its threads named for /proc, the server side of the front-end cost benchmark's HTTP runs
(http.launched_server starts it)."""

from __future__ import annotations

import ctypes
import sys
import threading
from types import FrameType


def serve_with_thread_names(names_path: str, server_argv: list[str]) -> int:
    """Run `beamline serve` with each Python thread's name given to its OS thread (comm) and
    written with its tid to `names_path`, so /proc tells the event loop, the engine thread and
    the native threads each of them started (they inherit their creator's comm) apart. Python
    3.11 does not name OS threads itself."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_name = 15

    def name_this_thread(name: str) -> None:
        libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        with open(names_path, "a", encoding="utf-8") as f:
            f.write(f"{threading.get_native_id()}\t{name}\n")

    def first_call(frame: FrameType, event: str, arg: object) -> None:
        sys.setprofile(None)  # once per thread: the hook costs nothing after this
        name_this_thread(threading.current_thread().name)

    threading.setprofile(first_call)  # type: ignore[arg-type]
    name_this_thread(threading.current_thread().name)
    from server.cli import main

    return main(["serve", *server_argv])


if __name__ == "__main__":
    sys.exit(serve_with_thread_names(sys.argv[1], sys.argv[2:]))

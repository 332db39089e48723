"""uvicorn with a graceful drain: on SIGTERM stop admitting, let in-flight requests finish, exit 0.

uvicorn's own handling closes the listener and re-raises the signal after shutdown (exit status
143). We instead mark the server as draining (new generation requests and /ready get 503), wait
until no request is in flight or `drain_timeout` passes, then ask uvicorn to exit normally.

A model that fails to load (in the background, after the port opened) stops the server too:
`run_server` then raises ModelLoadFailed, and `beamline serve` exits 1 (a pod restarts; a person
sees the one-line reason) instead of answering 503 forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from server.api.app import ServingState, create_app
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.state.draining:
            super().handle_exit(sig, frame)  # Ctrl-C, or a second SIGTERM: uvicorn's usual way
            return
        self.state.draining = True
        log.info(
            "SIGTERM: draining %d in-flight request(s) for up to %.0fs",
            self.state.in_flight,
            self.drain_timeout,
        )
        asyncio.get_event_loop().create_task(self._drain())

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks every 0.1 s whether to exit: also once the model failed to load."""
        return self.state.load_error is not None or await super().on_tick(counter)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            log.warning(
                "drain timeout: %d request(s) still in flight are cut off", self.state.in_flight
            )
        self.should_exit = True


def run_server(config: ServerConfig) -> None:
    """Serve until SIGTERM / Ctrl-C; ModelLoadFailed (already logged) if the model did not load."""
    app = create_app(loader=lambda: build_serving_context(config), config=config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # our middleware logs each request with its id
        log_config=None,  # keep our logging set-up
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_graceful_shutdown=1,
    )
    state = app.state.serving
    DrainingServer(uv_config, state, config.drain_timeout).run()
    if state.load_error is not None:
        raise ModelLoadFailed(str(state.load_error)) from state.load_error

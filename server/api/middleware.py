"""ASGI middleware: request ids (X-Request-Id accepted and returned) and one access-log line each
(at DEBUG for health probes and metrics scrapes).

Pure ASGI rather than BaseHTTPMiddleware so streamed responses pass through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.logs import request_id_var

log = logging.getLogger("beamline.access")
# Probes and scrapes arrive every few seconds: their lines are debug lines, not the log's bulk.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _VALID_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        start = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.log(
                logging.DEBUG if scope["path"] in PROBE_PATHS else logging.INFO,
                "%s %s %d",
                scope["method"],
                scope["path"],
                status,
                extra={
                    "status": status,
                    "duration_ms": round((time.monotonic() - start) * 1000, 1),
                    "client": (scope.get("client") or ("-",))[0],
                },
            )
            request_id_var.reset(token)

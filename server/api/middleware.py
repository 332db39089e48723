"""ASGI middleware: request ids (X-Request-Id accepted and returned) and one access-log line each;
JSON bodies read as JSON whatever Content-Type simple clients send.

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
            log.info(
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


# What clients send with a JSON body when they do not say application/json: curl -d (a form),
# text/plain (browsers' simple requests), or nothing at all.
READ_AS_JSON = frozenset({"", "application/x-www-form-urlencoded", "text/plain"})
SENT_CONTENT_TYPE = "beamline.sent_content_type"  # scope key: the type a rewritten body came with


class JSONBodyMiddleware:
    """A request body sent as a form, as text/plain or with no Content-Type is read as JSON, as
    OpenAI's API reads it: `curl -d '{...}'` without `-H content-type:application/json` works.
    The type it came with stays in the scope, so that a body that does not parse gets an error
    naming the header (errors.py). Other types (multipart, ...) are left as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = scope["headers"]
            sent = dict(headers).get(b"content-type", b"").decode("latin-1")
            if sent.split(";")[0].strip().lower() in READ_AS_JSON:
                scope = dict(scope)
                scope["headers"] = [
                    *((k, v) for k, v in headers if k != b"content-type"),
                    (b"content-type", b"application/json"),
                ]
                scope[SENT_CONTENT_TYPE] = sent or "(none)"
        await self.app(scope, receive, send)

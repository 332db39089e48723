"""ASGI guards that run before routing: API-key authentication and request body size limits.

Authentication is default-deny: every path needs a key except the public ones, compared after
normalising the path (percent-decoding, collapsing `//`, dropping a trailing `/`), so no spelling
of a model route slips past. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import posixpath
from collections.abc import Iterable
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def normalise_path(path: str) -> str:
    decoded = path
    for _ in range(3):  # undo double encoding too (%252F -> %2F -> /)
        once = unquote(decoded)
        if once == decoded:
            break
        decoded = once
    norm = posixpath.normpath("/" + decoded.replace("\\", "/"))
    return "/" if norm in ("/", "//") else norm.rstrip("/").replace("//", "/")


async def _send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    code: str,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyGuard:
    def __init__(self, app: ASGIApp, keys: Iterable[str], public_paths: Iterable[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys if k]
        self.public = {normalise_path(p) for p in public_paths}

    def _authorised(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        token = token.strip()
        # Compare against every key so timing does not reveal which (or whether any) prefix matched.
        return any([hmac.compare_digest(token, key) for key in self.keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if normalise_path(scope["path"]) in self.public:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        if not self._authorised(header):
            await _send_error(
                send,
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                "authentication_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodySizeGuard:
    """413 for bodies over `max_bytes` (the paths of `by_path` over their own limits: audio
    uploads), by Content-Length or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int, by_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.by_path = by_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.by_path.get(scope.get("path", ""), self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        too_big = f"request body exceeds {limit} bytes"
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_error(send, 413, too_big, "invalid_request_error", "body_too_large")
            return
        # Read the whole (bounded) body first, so an oversized chunked body is refused cleanly
        # before any handler runs, then replay it to the app.
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                await _send_error(send, 413, too_big, "invalid_request_error", "body_too_large")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

"""The decoding playground page (server/playground/), served by the server itself at `/`.

Three static files, read once: each is sent with an ETag (a conditional GET gets a 304), with
`Cache-Control: no-cache` (browsers revalidate, so a new release shows at once), gzipped for
clients that accept it, and with a Content-Security-Policy that lets the page load only its own
files and talk only to this server. The page uses the public API and nothing else.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

PAGE_DIR = Path(__file__).resolve().parents[1] / "playground"
# URL path -> (file in PAGE_DIR, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/playground/style.css": ("style.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = tuple(FILES)  # the page is public; the API behind it keeps its keys
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    gzipped: bytes
    etag: str
    media_type: str


def load_files() -> dict[str, StaticFile]:
    files = {}
    for path, (name, media_type) in FILES.items():
        body = (PAGE_DIR / name).read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        files[path] = StaticFile(body, gzip.compress(body, mtime=0), etag, media_type)
    return files


def install_playground(app: FastAPI) -> None:
    files = load_files()

    async def serve(request: Request) -> Response:
        page = files[request.url.path]
        headers = {
            "ETag": page.etag,
            "Cache-Control": "no-cache",
            "Vary": "Accept-Encoding",
            **SECURITY_HEADERS,
        }
        if page.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        body = page.body
        if "gzip" in request.headers.get("accept-encoding", ""):
            body, headers["Content-Encoding"] = page.gzipped, "gzip"
        return Response(body, media_type=page.media_type, headers=headers)

    for path in files:
        app.add_api_route(path, serve, methods=["GET", "HEAD"], include_in_schema=False)

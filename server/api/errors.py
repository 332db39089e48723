"""Every error leaves the server in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from decoding import DecodingParamsError
from server.api.extension_fields import refused

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


MAX_PARAM_CHARS = 200
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc_to_param(loc: tuple) -> str | None:
    """The request field an error is about. pydantic adds the name of the union member it tried
    (`str`, `list[int]`, `TextPart`, ...) to the location; those are types, not fields."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (_FIELD_NAME.fullmatch(p) and p not in _TYPE_TAGS)
    ]
    return ".".join(p for p in parts if p != "body") or None


def install_error_handlers(
    app: FastAPI, on_client_error: Callable[[], None] = lambda: None
) -> None:
    """Map every exception to the OpenAI error shape; `on_client_error` counts rejected requests."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if 400 <= exc.status < 500 and exc.status != 429:
            on_client_error()
        return exc.response()

    @app.exception_handler(DecodingParamsError)
    async def _params_error(_: Request, exc: DecodingParamsError) -> JSONResponse:
        on_client_error()
        return bad_request(exc.message, param=exc.field, code="invalid_value").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        on_client_error()
        errors = exc.errors()
        first: dict[str, Any] = (
            errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        )
        if first.get("type") == "json_invalid":
            return bad_request("request body is not valid JSON", code="invalid_json").response()
        param = _loc_to_param(tuple(first.get("loc", ())))
        code = "invalid_value"
        if param is not None and len(param) > MAX_PARAM_CHARS:  # never echo a huge key back
            param = param[:MAX_PARAM_CHARS] + "..."
        entry = refused(param or "") if first.get("type") == "extra_forbidden" else None
        if entry is not None:
            code = "unsupported"
            message = f"{param} is not supported by this server: {entry.meaning}"
        elif first.get("type") == "extra_forbidden":
            code = "unknown_field"
            message = (
                f"unknown field {param!r}: this server does not implement it (fields that change "
                "nothing here are accepted; see README, Request fields)"
            )
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return bad_request(message, param=param, code=code).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, "internal server error", code="internal_error").response()

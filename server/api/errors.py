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
MAX_PROBLEMS = 10  # validation problems named in one message
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# pydantic's errors of a body that is no object (JSON of another kind, or not read as JSON)
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})
# pydantic error types that are already the code a client should see
_CODES = {
    "extra_forbidden": "unknown_field",
    "missing_required_parameter": "missing_required_parameter",
}


def _loc_to_param(loc: tuple) -> str | None:
    """The request field an error is about. pydantic adds the name of the union member it tried
    (`str`, `list[int]`, `TextPart`, ...) to the location; those are types, not fields."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (_FIELD_NAME.fullmatch(p) and p not in _TYPE_TAGS)
    ]
    param = ".".join(p for p in parts if p != "body") or None
    if param is not None and len(param) > MAX_PARAM_CHARS:  # never echo a huge key back
        param = param[:MAX_PARAM_CHARS] + "..."
    return param


def validation_error(exc: RequestValidationError, sent_content_type: str | None) -> APIError:
    """A 400 naming every problem of the body (up to MAX_PROBLEMS), `param` the first one's
    field. `sent_content_type`: the Content-Type of a body that was not sent as JSON (so not
    read as JSON): the error names the header and its fix. Such a body is refused rather than
    read as JSON anyway: a browser sends text/plain and form posts to any site without asking
    (no CORS preflight), and a server on localhost would serve them."""
    errors: list[dict[str, Any]] = list(exc.errors()) or [{"loc": (), "msg": "invalid request"}]
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _invalid_json(first, exc.body)
    problems = [_problem(e) for e in errors]
    param, code = problems[0][0], problems[0][1]
    if param is None and first.get("type") in _NOT_AN_OBJECT:
        message = "the request body must be a JSON object"
        if sent_content_type:
            message += (
                f" sent with the header Content-Type: application/json (it came with "
                f"{sent_content_type}; with curl: -H 'Content-Type: application/json')"
            )
            code = "invalid_content_type"
        return bad_request(message, None, code)
    shown = [text for _, _, text in problems[:MAX_PROBLEMS]]
    more = len(problems) - len(shown)
    message = "; ".join(shown) + (f"; and {more} more" if more else "")
    if len(problems) > 1:
        message = f"{len(problems)} problems: {message}"
    return bad_request(message, param, code)


def _problem(error: dict[str, Any]) -> tuple[str | None, str, str]:
    """(param, code, message) of one validation error."""
    param = _loc_to_param(tuple(error.get("loc", ())))
    code = _CODES.get(error.get("type", ""), "invalid_value")
    if code == "unknown_field":
        entry = refused(param or "")
        if entry is not None:
            return param, "unsupported", f"{param} is not supported by this server: {entry.meaning}"
        message = (
            f"unknown field {param!r}: this server does not implement it (fields that change "
            "nothing here are accepted; see docs/reference/request-fields.md)"
        )
        return param, code, message
    return param, code, f"{param}: {error['msg']}" if param else str(error["msg"])


def _invalid_json(error: dict[str, Any], body: Any) -> APIError:
    """JSON that does not parse: where (line, column and the text around it) and why."""
    reason = (error.get("ctx") or {}).get("error", "invalid JSON")
    message = f"request body is not valid JSON: {reason}"
    position = error.get("loc", ())[-1:]
    if isinstance(body, str) and position and isinstance(position[0], int):
        pos = position[0]
        line = body.count("\n", 0, pos) + 1
        column = pos - (body.rfind("\n", 0, pos) + 1) + 1
        excerpt = body[max(0, pos - 20) : pos + 20]
        message += f" at line {line}, column {column} (near {excerpt!r})"
    return bad_request(message, code="invalid_json")


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
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_client_error()
        sent = request.headers.get("content-type")
        not_json = None if sent is not None and "json" in sent else sent or "no Content-Type"
        return validation_error(exc, not_json).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, "internal server error", code="internal_error").response()

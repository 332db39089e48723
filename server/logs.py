"""Logging set-up: plain text or one JSON object per line, with the request id when there is one."""

from __future__ import annotations

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)

# Record attributes that are not `extra` fields; uvicorn's `color_message` is its message again
# with terminal colour codes, noise in a log file or a JSON line.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
# uvicorn's lifespan lines: "startup complete" appears as the port opens, while the model is still
# loading, so they are debug lines; bootstrap logs "ready: serving ..." once the engine runs.
_UVICORN_LIFESPAN = frozenset(
    {
        "Waiting for application startup.",
        "Application startup complete.",
        "Waiting for application shutdown.",
        "Application shutdown complete.",
    }
)


class JsonFormatter(logging.Formatter):
    """`extra={...}` fields become JSON keys, so access and request lines are machine-readable."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        entry.update(
            {k: v for k, v in vars(record).items() if k not in _STANDARD and k != "request_id"}
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return line


class UvicornLifespanAtDebug(logging.Filter):
    """Lowers uvicorn's lifespan lines to DEBUG (dropped unless the root logger shows DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "uvicorn.error" or record.msg not in _UVICORN_LIFESPAN:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(UvicornLifespanAtDebug())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

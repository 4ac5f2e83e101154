"""Log lines of every QUART process: levels, an optional JSON format, and replicas' access lines.

``QUART_LOG_LEVEL`` (``debug``/``info``/``warning``/``error``; default ``info``) and ``QUART_LOG_FORMAT``
(``text`` or ``json``; default ``text``) are read once by :func:`log_settings`. :func:`configure` sets the
root logger of a gateway, plugin or KeysManager process from them.

A replica writes one **access line** per request to its stderr, which the host keeps as the function's log
(``GET /system/logs``, ``faas-cli logs``, ``quartctl logs``)::

    2026-11-24T17:52:32.655Z INFO access call_id=4f1c… method=POST path=/ status=200 duration_ms=12.31 bytes_in=10 bytes_out=20 pid=123

or the same fields as one JSON object with ``QUART_LOG_FORMAT=json``. :class:`AccessLog` wraps any WSGI app
(the stage runtime under the KeysManager or gunicorn). ``call_id`` is the request's ``X-Call-Id`` (the gateway's),
else its ``X-Quart-Request-Id`` (the pipeline router's, the call id unless the client chose one) and also writes an ``ERROR`` line with the traceback of
any exception the app lets through. Health probes (``/_/health``) are not logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from quart_stage.settings import settings_from_env

HEALTH_PATH = "/_/health"


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "info"
    format: str = "text"

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            from quart_stage.settings import ConfigError

            raise ConfigError(f"QUART_LOG_FORMAT must be text or json, got {self.format!r}")
        if logging.getLevelName(self.level.upper()) not in (10, 20, 30, 40, 50):
            from quart_stage.settings import ConfigError

            raise ConfigError(f"QUART_LOG_LEVEL must be debug, info, warning or error, got {self.level!r}")


def log_settings(env: dict[str, str] | None = None) -> LogSettings:
    return settings_from_env(LogSettings, "QUART_LOG_", env)


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def format_line(level: str, event: str, fields: dict[str, Any], json_format: bool, t: float | None = None) -> str:
    """One log line (no newline): ``<time> <LEVEL> <event> k=v ...`` or a JSON object."""
    t = time.time() if t is None else t
    if json_format:
        return json.dumps({"time": _stamp(t), "level": level.lower(), "event": event, **fields},
                          separators=(",", ":"), default=str)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "traceback")
    line = f"{_stamp(t)} {level.upper()} {event} {text}".rstrip()
    if fields.get("traceback"):
        line += "\n" + str(fields["traceback"]).rstrip()
    return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {"logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            fields["traceback"] = self.formatException(record.exc_info)
        return format_line(record.levelname, "log", fields, True, record.created)


def configure(settings: LogSettings | None = None, stream: Any = None) -> LogSettings:
    """The root logger at ``QUART_LOG_LEVEL`` in ``QUART_LOG_FORMAT`` (text: time, logger, level, message)."""
    settings = settings or log_settings()
    handler = logging.StreamHandler(stream)
    if settings.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
    return settings


def write_stderr(line: str) -> None:
    """One line to fd 2 in one write (whole lines even when forked replicas share the file)."""
    os.write(2, (line + "\n").encode(errors="replace"))


class AccessLog:
    """WSGI middleware: an access line per request, an ERROR line with the traceback of an uncaught exception."""

    def __init__(self, app: Callable, write: Callable[[str], None] = write_stderr,
                 settings: LogSettings | None = None) -> None:
        self.app = app
        self.write = write
        self.json = (settings or log_settings()).format == "json"

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == HEALTH_PATH:  # probes: not logged, passed through as they are
            return self.app(environ, start_response)
        return self._logged(environ, start_response)

    def _logged(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        started = time.perf_counter()
        fields: dict[str, Any] = {
            "call_id": environ.get("HTTP_X_CALL_ID") or environ.get("HTTP_X_QUART_REQUEST_ID") or "-", "method": environ.get("REQUEST_METHOD", ""),
            "path": path or "/", "status": 0, "duration_ms": 0.0,
            "bytes_in": int(environ.get("CONTENT_LENGTH") or 0), "bytes_out": 0, "pid": os.getpid(),
        }

        def recording_start(status: str, headers: list, exc_info: Any = None):
            fields["status"] = int(status.split(" ", 1)[0])
            return start_response(status, headers, exc_info) if exc_info else start_response(status, headers)

        iterable: Any = ()
        try:
            iterable = self.app(environ, recording_start)
            for chunk in iterable:
                fields["bytes_out"] += len(chunk)
                yield chunk
        except Exception as exc:
            fields["status"] = fields["status"] or 500
            self._done(fields, started, "ERROR", error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc())
            raise
        finally:
            if hasattr(iterable, "close"):
                iterable.close()
        self._done(fields, started, "ERROR" if fields["status"] >= 500 else "INFO")

    def _done(self, fields: dict, started: float, level: str, **extra: Any) -> None:
        fields["duration_ms"] = round(1000 * (time.perf_counter() - started), 2)
        self.write(format_line(level, "access", {**fields, **extra}, self.json))

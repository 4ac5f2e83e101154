"""The one error type answered as ``{"error": message, "field": field}`` with an HTTP status.

Every component (stage runtime, KeysManager, provider, plugin) raises :class:`QuartError` for what
the caller did wrong (4xx) or what it cannot do now (429/503 with ``Retry-After``); each HTTP layer
renders it the same way. ``field`` names the offending request field, header or label when there is one.
"""

from __future__ import annotations

from collections.abc import Mapping


class QuartError(Exception):
    """An answer that is not a result: ``status``, a sentence, the field it is about, extra headers."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: Mapping[str, str] | None = None, detail: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = dict(headers or {})
        self.detail = dict(detail or {})  # more JSON keys of the answer (e.g. ``held`` of a 409 session mismatch)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def to_json(self) -> dict:
        out: dict = {"error": self.message}
        if self.field:
            out["field"] = self.field
        out.update(self.detail)
        return out


def invalid(field: str, message: str, status: int = 400) -> QuartError:
    """A 4xx (400 unless said) about one request field."""
    return QuartError(status, message, field)


def unavailable(status: int, message: str, retry_after_s: float) -> QuartError:
    """A 429 or 503 with ``Retry-After`` (whole seconds, at least 1)."""
    return QuartError(status, message, None, {"Retry-After": str(max(1, int(round(retry_after_s))))})

"""The one error type a stage answers with a 4xx: it names the offending field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageInputError(Exception):
    """A request the stage refuses. Rendered as ``{"error": message, "field": field}`` with `status`."""

    field: str
    message: str
    status: int = 400

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"

    def to_json(self) -> dict:
        return {"error": self.message, "field": self.field}

"""What a stage answers (:class:`StageResponse`) and the X-Quart-* timing headers every answer carries."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from quart_stage.errors import QuartError

JSON_TYPE = "application/json"
H_REQUEST_ID, H_MODEL, H_STAGE = "X-Quart-Request-Id", "X-Quart-Model", "X-Quart-Stage"
H_DESER, H_COMPUTE, H_SER, H_MODE = (
    "X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms", "X-Quart-Compute-Mode")


@dataclass
class StageResponse:
    """What a stage answers: status, body chunks (bytes), headers. `body` joins the chunks."""

    status: int
    chunks: list[bytes]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> bytes:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)

    @classmethod
    def error(cls, exc: QuartError, headers: dict[str, str] | None = None) -> StageResponse:
        return cls.json(exc.status, exc.to_json(), headers)

    @classmethod
    def json(cls, status: int, payload: dict, headers: dict[str, str] | None = None) -> StageResponse:
        h = {"Content-Type": JSON_TYPE, **(headers or {})}
        return cls(status, [json.dumps(payload).encode()], h)


def elapsed_ms(start: float, end: float | None = None) -> str:
    """``end - start`` (perf_counter seconds; ``end`` defaults to now) as the milliseconds of a timing header."""
    return f"{((end if end is not None else time.perf_counter()) - start) * 1000.0:.3f}"

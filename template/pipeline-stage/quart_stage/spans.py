"""Layer ranges on the wire, without torch (the gateway and the router read them too).

A range is half-open ``[A, B)`` in a model's layer list ``[embeddings, block_0 .. block_{L-1}, head]``, written
``A-B``: ``X-Quart-Layers`` asks a stage replica for a part of its stage (and says what it ran),
``X-Quart-Layers-Held`` says which layers it can run now (docs/stage-runtime.md).
"""

from __future__ import annotations

import re

H_LAYERS, H_LAYERS_HELD = "X-Quart-Layers", "X-Quart-Layers-Held"
SPAN = re.compile(r"^\s*(\d{1,6})\s*-\s*(\d{1,6})\s*$")

Span = tuple[int, int]


def parse_span(text: str | None) -> Span | None:
    """``"A-B"`` → ``(A, B)`` with ``A < B``; None for a missing or malformed value."""
    m = SPAN.match(text) if text else None
    if m is None:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    return (a, b) if a < b else None


def fmt(span: Span) -> str:
    return f"{span[0]}-{span[1]}"


def kv_charge(positions: int, part: Span | None, stage: Span | None) -> int:
    """The KV-cache positions a session holding ``positions`` is charged for on a replica that runs ``part`` of a
    stage's layers ``stage`` (None: all of them): its share of the stage's layers, rounded up. The stage's session
    table and the gateway's booking use this one rule, so they agree to the position."""
    if part is None or stage is None or part == stage:
        return positions
    return -(-positions * (part[1] - part[0]) // max(1, stage[1] - stage[0]))

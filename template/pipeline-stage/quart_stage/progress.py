"""The progress file of a stage file still arriving: which of its layers are present and verified.

Written by the transfer's writer (``keysmanager.transfer``, ``keysmanager.parts``) after each layer's sha256
matched, read by a live replica per request (``quart_stage.layers.LiveProgress``). No torch: the KeysManager
daemon reads it too.

Two formats, told apart by length: 8 bytes (one little-endian u64 ``k``: layers ``[0, k)`` of the stage, a file
arriving in order — BlitzScale's live start) or 16 bytes (two u64 ``lo, hi``: layers ``[lo, hi)`` of the stage,
relative to its first — a ParaServe part start, which fetches its part first and then grows the range both
ways). Indices are relative to the stage's first layer. The verified range only ever grows.
"""

from __future__ import annotations

import os
import struct

PROGRESS_FORMAT = "<Q"
"""One little-endian u64: the number of the stage's layers (from its start) verified."""
RANGE_FORMAT = "<QQ"
"""Two little-endian u64: the verified range ``[lo, hi)`` of the stage's layers (relative)."""


def read_range(path: str) -> tuple[int, int]:
    """The verified range ``(lo, hi)`` of a progress file in either format; ``(0, 0)`` when absent or short."""
    try:
        with open(path, "rb") as f:
            raw = f.read(16)
    except OSError:
        return 0, 0
    if len(raw) == 16:
        lo, hi = struct.unpack(RANGE_FORMAT, raw)
        return (lo, hi) if lo < hi else (0, 0)
    if len(raw) >= 8:
        return 0, struct.unpack(PROGRESS_FORMAT, raw[:8])[0]
    return 0, 0


def read_progress(path: str) -> int:
    """The verified *prefix* (layers from the stage's first): ``hi`` of a range starting at 0, else 0."""
    lo, hi = read_range(path)
    return hi if lo == 0 else 0


def _replace(path: str, raw: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
    os.replace(tmp, path)  # atomic: a reader sees the old or the new value


def write_progress(path: str, count: int) -> None:
    """Raise a prefix progress file to ``count`` (never lowers it)."""
    if read_progress(path) >= count:
        return
    _replace(path, struct.pack(PROGRESS_FORMAT, count))


def write_range(path: str, lo: int, hi: int) -> None:
    """Set the verified range to ``[lo, hi)``; ignored unless it contains the current one (never shrinks)."""
    old_lo, old_hi = read_range(path)
    if lo >= hi or (old_lo < old_hi and not (lo <= old_lo and old_hi <= hi)) or (lo, hi) == (old_lo, old_hi):
        return
    _replace(path, struct.pack(RANGE_FORMAT, lo, hi))

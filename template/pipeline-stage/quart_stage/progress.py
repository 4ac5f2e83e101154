"""The progress file of a stage file still arriving: how many of its layers (from the stage's first) are
present and verified. Written by the transfer's writer (``keysmanager.transfer``) after each layer's sha256
matched, read by a live replica per request (``quart_stage.layers.LiveProgress``). No torch: the KeysManager
daemon reads it too."""

from __future__ import annotations

import os
import struct

PROGRESS_FORMAT = "<Q"
"""One little-endian u64: the number of the stage's layers (from its start) verified."""


def read_progress(path: str) -> int:
    """The verified-layer count of a progress file (0 when absent or short)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
    except OSError:
        return 0
    return struct.unpack(PROGRESS_FORMAT, raw)[0] if len(raw) == 8 else 0


def write_progress(path: str, count: int) -> None:
    """Raise a progress file to ``count`` (never lowers it); replaced atomically, so a reader sees old or new."""
    if read_progress(path) >= count:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack(PROGRESS_FORMAT, count))
    os.replace(tmp, path)

"""Bodies of durable async calls kept beside the stream, not in it (issue 31, item 3).

JetStream's file store takes messages up to about 32 MiB: a 32 MiB ``/async-function`` body was refused
as "message too large", which the gateway read as a full queue (429, for ever). And a body read whole,
then copied into a NATS message, held two or three copies per call in the gateway (1.6 GB for 20 bodies).
Here a body over :data:`SPILL_BYTES` (or of unknown length) streams piece by piece into
``<state>/async-bodies/<id>`` (0600) as it arrives; the stream's message carries its name
(``Quart-Body-File``), the queue worker streams the file to the function and removes it once the call is
acked. Over ``limit`` bytes: 413 naming the limit, the partial file removed. Small bodies stay in the message.
A body still arriving is ``<id>.part``, renamed when whole: the parts a gateway killed mid-upload left behind are
removed when the next gateway opens the folder.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from aiohttp import web
from quart_provider.bodies import read_body, too_large
from quart_stage.errors import QuartError

SPILL_BYTES = 1 << 20  # larger bodies go to a file, smaller ones in the message
_PIECE = 256 * 1024


class BodyStore:
    """Async-call bodies on disk, by name (a UUID hex: never a path from the client)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in folder.glob("*.part"):  # uploads a killed gateway never finished: no message names them
            stale.unlink(missing_ok=True)

    def path(self, name: str) -> Path:
        if not name or not all(c in "0123456789abcdef" for c in name):
            raise ValueError(f"not a body file name: {name!r}")
        return self.folder / name

    async def receive(self, request: web.Request, limit: int) -> tuple[bytes, str | None]:
        """(the body, None) when small and of known length, else (b"", the file it was streamed to)."""
        declared = request.content_length
        if declared is not None and declared <= SPILL_BYTES:
            return await read_body(request, limit), None
        if declared is not None and declared > limit:
            raise too_large(limit, declared)
        name = uuid.uuid4().hex
        path = self.path(name)
        part = path.with_name(name + ".part")
        size = 0
        try:
            with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                while piece := await request.content.read(_PIECE):
                    size += len(piece)
                    if size > limit:
                        raise too_large(limit)
                    out.write(piece)
            if declared is not None and size < declared:
                raise QuartError(400, f"request body is truncated: Content-Length {declared}, {size} bytes arrived",
                                 "body")
            part.rename(path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return b"", name

    def remove(self, name: str | None) -> None:
        if name:
            self.path(name).unlink(missing_ok=True)

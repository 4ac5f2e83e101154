"""Test helper: one in-process stage replica (a :class:`quart_stage.runtime.StageRuntime`) over HTTP."""

from __future__ import annotations

import asyncio

from aiohttp import web
from quart_stage import wire
from quart_stage.runtime import StageRuntime


class StageServer:
    """One in-process stage replica over HTTP (aiohttp; compute in a thread), recording each safetensors call's
    batch rows (of a packed batch: its sequences)."""

    def __init__(self, runtime: StageRuntime, delay_s: float = 0.0) -> None:
        self.runtime, self.delay_s = runtime, delay_s
        self.rows: list[int] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.content_type != "application/json":  # a JSON body (text, ids) is the stage's to read
            tensors = wire.decode(body).tensors  # a packed batch: one row, its requests in segment_lengths
            packed = tensors.get("segment_lengths")
            self.rows.append(len(packed) if packed is not None else next(iter(tensors.values())).shape[0])
        await asyncio.sleep(self.delay_s)  # holds the replica so that the next requests queue up behind it
        resp = await asyncio.to_thread(self.runtime.handle, body, dict(request.headers))
        return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

    async def start(self) -> StageServer:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site.port}/"
        return self

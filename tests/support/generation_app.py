"""Test helper: the generation API (``gateway_plugin.generation``) served on its own event-loop thread over
stage replicas that speak the session protocol (tests/support/fake_session_stage.py), for HTTP clients (the
``openai`` package, requests) - no stage compute, so hundreds of requests take seconds."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.openai_api import GenerationAPI
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_tools.partition import partition

from support.fake_session_stage import FakeStage

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_models(root: Path) -> dict[str, str]:
    """The ``tiny`` decoder preset (byte-level tokenizer, given a ChatML template) and ``tiny-encoder``,
    partitioned into ``root``; model name -> folder."""
    dirs = {"tiny": str(root / "tiny"), "enc": str(root / "enc")}
    partition("tiny", 2, dirs["tiny"], progress=False)
    partition("tiny-encoder", 2, dirs["enc"], progress=False)
    (root / "tiny" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": None}))
    return dirs


class BackgroundLoop:
    """An event loop on its own thread: ``call(coro)`` runs a coroutine there; ``close()`` awaits ``_stop()`` there,
    then stops the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _stop(self) -> None:
        return None

    def close(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class GenerationServer(BackgroundLoop):
    """GenerationAPI + fake stages (two stages of ``tiny``) on a background loop; ``url`` serves ``/v1`` and
    ``/function/<model>``."""

    def __init__(self, dirs: dict[str, str], **config) -> None:
        super().__init__()
        self.dirs = dirs
        self.fakes: list[FakeStage] = []
        self.records = io.StringIO()  # the request records (QUART_RECORDS), one JSON line each
        self.collector = MetricsCollector(10.0, self.records)
        # the fake replicas speak the one-session step protocol only, not batched decode steps
        self.url = self.call(self._start(GenerationConfig(**{"replica_wait_s": 0.5, "decode_batch_max": 1, **config})))

    async def _start(self, config: GenerationConfig) -> str:
        self.source = StaticReplicas(slots=1)
        self.runners = []
        for i in range(2):
            fake = FakeStage(i, i == 1)
            self.fakes.append(fake)
            runner = web.AppRunner(fake.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            self.source.replicas[f"tiny-stage-{i}"] = [StaticReplica(f"tiny#{i}", f"http://127.0.0.1:{runner.addresses[0][1]}/")]
        pipelines = {name: [f"{name}-stage-0", f"{name}-stage-1"] for name in self.dirs}  # "tiny" is served
        self.engine = SessionEngine(self.source, config)
        self.api = GenerationAPI(self.engine, lambda: pipelines, self.dirs.get, config, self.collector)

        async def function(request: web.Request) -> web.StreamResponse:
            model = request.match_info["model"]
            answer = await self.api.function(request, model)
            return answer or web.json_response({"error": "a one-shot body (not served here)"}, status=418)

        app = web.Application()
        app.router.add_route("*", "/v1/{tail:.*}", self.api.v1)
        app.router.add_route("*", "/function/{model}", function)
        app.router.add_get("/metrics", lambda r: web.Response(body=self.collector.prometheus_text()))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def _stop(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()
        await self.engine.close()


def tiny_server(tmp_path_factory) -> Iterator[GenerationServer]:
    """A module fixture's body: the GenerationServer over ``tiny`` (and ``enc``) the /v1 tests share (64 KiB
    bodies, 8 tokens by default), closed after the module."""
    # a session with no KV room waits 2 s in line before its 429 (the default's 10 s raced the tests' 10 s client
    # timeouts: under load the client gave up first)
    running = GenerationServer(tiny_models(tmp_path_factory.mktemp("models")), max_body_bytes=64 * 1024,
                               default_max_tokens=8, room_wait_s=2.0)
    try:
        yield running
    finally:
        running.close()

"""Durable async calls as one part of `quartctl up`: the nats-server, the stream, the queue worker.

:class:`DurableAsync` is what :class:`~quart_provider.system.EmbeddedSystem` starts before the gateway
serves (``connect``: the server and the stream, so ``/async-function`` can accept), starts consuming once
the gateway serves and the stack is deployed (``start_worker``: calls accepted before a restart are run
by functions that exist again), and stops first (``stop``: the worker drains, then the connection, then
the server, so nothing accepted is lost). When NATS cannot start, the gateway still serves and
``/async-function`` answers 503 with the reason (``gateway.async_unavailable``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from quart_provider.async_bodies import BodyStore
from quart_provider.async_queue import AsyncQueue
from quart_provider.callbacks import CallbackPolicy, CallbackSender
from quart_provider.config import GatewayConfig
from quart_provider.gateway import EmbeddedGateway
from quart_provider.nats_server import NatsServer, NatsUnavailable, load_or_create_token
from quart_provider.queue_worker import QueueWorker, parse_codes

log = logging.getLogger("quart.gateway.async")


@dataclass(slots=True)
class DurableAsync:
    """nats-server + JetStream queue + worker, owned by one EmbeddedSystem."""

    config: GatewayConfig
    server: NatsServer | None = None
    queue: AsyncQueue | None = None
    worker: QueueWorker | None = None
    sender: CallbackSender | None = None

    async def connect(self, gateway: EmbeddedGateway) -> None:
        """Start the server and the stream; on failure log it and leave ``gateway.async_unavailable`` saying why."""
        cfg = self.config
        token = load_or_create_token(cfg.credentials_dir)
        self.server = NatsServer(cfg.state_dir / "nats", token, port=cfg.nats_port,
                                 max_payload=cfg.max_body_bytes + 64 * 1024, binary=cfg.nats_server or None)
        try:
            await self.server.start()
            self.queue = AsyncQueue(self.server.url, token, cfg.async_queue_cap, BodyStore(cfg.state_dir / "async-bodies"))
            await self.queue.connect()
        except (NatsUnavailable, OSError, Exception) as exc:  # noqa: BLE001 - the gateway serves without it
            gateway.async_unavailable = f"the NATS JetStream queue did not start: {type(exc).__name__}: {exc}"
            log.warning("%s; /async-function answers 503", gateway.async_unavailable)
            await self.stop(0)
            return
        gateway.async_queue = self.queue

    async def start_worker(self, gateway: EmbeddedGateway, gateway_url: str) -> None:
        if self.queue is None or self.worker is not None:
            return
        cfg = self.config
        self.sender = CallbackSender(CallbackPolicy.from_text(cfg.callback_allowed_networks), cfg.callback_timeout_s,
                                     cfg.callback_per_destination)
        self.worker = QueueWorker(self.queue, gateway_url, self.sender, workers=cfg.async_workers,
                                  timeout_s=cfg.async_timeout_s, ack_wait_s=cfg.async_ack_wait_s,
                                  max_attempts=cfg.async_max_attempts, initial_retry_s=cfg.async_initial_retry_s,
                                  max_retry_wait_s=cfg.async_max_retry_wait_s,
                                  retry_codes=parse_codes(cfg.async_retry_codes))
        await self.worker.start()
        gateway.metrics.registry.register(self.worker)

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    async def stop_worker(self, drain_s: float) -> None:
        """Take no new calls; running ones get ``drain_s``, the rest stay in the stream."""
        if self.worker is not None:
            await self.worker.stop(drain_s)
            self.worker = None

    async def stop(self, drain_s: float) -> None:
        """The worker drains (unfinished calls stay in the stream), then the connection and the server stop."""
        await self.stop_worker(drain_s)
        if self.sender is not None:
            await self.sender.close()
            self.sender = None
        if self.queue is not None:
            await self.queue.close()
            self.queue = None
        if self.server is not None:
            self.server.stop()
            self.server = None

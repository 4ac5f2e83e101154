"""The KeysManager process: claim the state dir, run the manager, serve its API on a Unix socket (mode 0600)
and, with ``listen``, on TCP to holders of the cluster's bearer token, until SIGTERM/SIGINT or
``POST /v1/shutdown``, then clean up."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from aiohttp import web

from keysmanager.api import build_app
from keysmanager.auth import read_token
from keysmanager.config import KeysManagerConfig
from keysmanager.manager import KeysManager
from keysmanager.recovery import claim_state_dir, release_state_dir


async def listen(km: KeysManager, socket_path: Path) -> web.AppRunner:
    """Serve ``km``'s API on ``socket_path``, created 0600: only our user may talk to us."""
    runner = web.AppRunner(build_app(km), access_log=None, handle_signals=False)
    await runner.setup()
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    old_umask = os.umask(0o177)
    try:
        await web.UnixSite(runner, str(socket_path)).start()
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    return runner


async def listen_tcp(km: KeysManager, host: str, port: int, token: str) -> web.AppRunner:
    """Serve ``km``'s API on ``host:port`` to requests carrying ``token`` only."""
    runner = web.AppRunner(build_app(km, token), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


async def serve(config: KeysManagerConfig) -> None:
    """Run a KeysManager until SIGTERM/SIGINT or ``POST /v1/shutdown``. Raises RuntimeError when another
    KeysManager holds the state dir or the TCP address is taken; ValueError for an unusable token file."""
    token = read_token(config.token_file) if config.listen else None  # before anything starts
    claim_state_dir(config.state_path)
    km = KeysManager(config)
    await km.start()
    runners: list[web.AppRunner] = []
    try:
        runners.append(await listen(km, config.socket_path))
        if token is not None:
            try:
                runners.append(await listen_tcp(km, *config.listen_address, token))
            except OSError as exc:
                raise RuntimeError(f"cannot listen on {config.listen}: {exc.strerror or exc}") from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, km.request_stop)
        print(f"keysmanager {config.name} listening on {config.socket_path}"
              + (f" and on {config.listen} (bearer token)" if token is not None else ""), flush=True)
        await km.wait_stopped()
    finally:
        await km.close()
        for runner in runners:
            await runner.cleanup()
        config.socket_path.unlink(missing_ok=True)
        release_state_dir(config.state_path)

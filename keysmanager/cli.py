"""``quartctl keysmanager`` / ``python -m keysmanager.daemon``: run one KeysManager in the foreground."""

from __future__ import annotations

import asyncio
import sys

from quart_stage import cliargs
from quart_stage.logs import configure as configure_logs

from keysmanager.config import KeysManagerConfig
from keysmanager.server import serve
from keysmanager.types import FORK_MODES


def main(argv: list[str]) -> int:
    parser = cliargs.ArgumentParser(prog="quartctl keysmanager", description="run one KeysManager host agent")
    parser.add_argument("--name", help="host name (default host-0)")
    parser.add_argument("--socket", help="API Unix socket path (default <state-dir>/km.sock)")
    parser.add_argument("--state-dir", help="pidfile, state and logs (default $XDG_RUNTIME_DIR or /tmp)")
    parser.add_argument("--memory-limit", type=int, help="bytes of parameters this host may cache (default: "
                                                         "85%% of host memory, see --memory-threshold)")
    parser.add_argument("--memory-threshold", type=float, help="fraction of host memory that triggers eviction")
    parser.add_argument("--gpus", type=int, help="GPU slots of this host (0 = CPU host)")
    parser.add_argument("--fork-mode", choices=FORK_MODES, help="default replica mode (cow)")
    parser.add_argument("--shm-dir", help="parameter segments folder (default /dev/shm)")
    parser.add_argument("--landing-mb", type=int,
                        help="MiB of pages kept touched in the state dir for the next stage file to land in (default 0)")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="also serve the API on TCP, only to clients sending the bearer token of --token-file")
    parser.add_argument("--token-file", help="file holding the bearer token (mode 0600; required with --listen)")
    parser.add_argument("--host-address", help="this host's address: replicas listen on it (default 127.0.0.1)")
    args = parser.parse_args(argv)
    try:
        configure_logs()  # QUART_LOG_LEVEL, QUART_LOG_FORMAT (text or json)
        config = KeysManagerConfig.from_env(
            name=args.name, socket=args.socket, state_dir=args.state_dir, memory_limit=args.memory_limit,
            memory_threshold=args.memory_threshold, gpus=args.gpus, fork_mode=args.fork_mode,
            shm_dir=args.shm_dir, landing_mb=args.landing_mb, listen=args.listen, token_file=args.token_file, host_address=args.host_address)
        asyncio.run(serve(config))
    except (ValueError, RuntimeError) as exc:
        print(f"quartctl keysmanager: {exc}", file=sys.stderr)
        return 2
    return 0


"""``quartctl keysmanager`` / ``python -m keysmanager.daemon``: run one KeysManager in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import sys

from keysmanager.config import KeysManagerConfig
from keysmanager.server import serve
from keysmanager.types import FORK_MODES


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="quartctl keysmanager", description="run one KeysManager host agent")
    parser.add_argument("--name", help="host name (default host-0)")
    parser.add_argument("--socket", help="API Unix socket path (default <state-dir>/km.sock)")
    parser.add_argument("--state-dir", help="pidfile, state and logs (default $XDG_RUNTIME_DIR or /tmp)")
    parser.add_argument("--memory-limit", type=int, help="bytes of parameters this host may cache (default: "
                                                         "85%% of host memory, see --memory-threshold)")
    parser.add_argument("--memory-threshold", type=float, help="fraction of host memory that triggers eviction")
    parser.add_argument("--gpus", type=int, help="GPU slots of this host (0 = CPU host)")
    parser.add_argument("--fork-mode", choices=FORK_MODES, help="default replica mode (cow)")
    parser.add_argument("--shm-dir", help="parameter segments folder (default /dev/shm)")
    args = parser.parse_args(argv)
    try:
        config = KeysManagerConfig.from_env(
            name=args.name, socket=args.socket, state_dir=args.state_dir, memory_limit=args.memory_limit,
            memory_threshold=args.memory_threshold, gpus=args.gpus, fork_mode=args.fork_mode,
            shm_dir=args.shm_dir)
        asyncio.run(serve(config))
    except (ValueError, RuntimeError) as exc:
        print(f"quartctl keysmanager: {exc}", file=sys.stderr)
        return 2
    return 0


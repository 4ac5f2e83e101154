"""`quartctl bench hosts [--out FILE]`: several hosts on real addresses (network namespaces, tbf-limited NICs).

Three measurements, each on its own namespaces, all removed at the end (also on failure):

1. ``registry_fetch``: a host fetches a stage-sized object (``--stage-gb``, default 1 GB) from the model
   registry (moto's S3 server in a namespace of its own, ``--registry-gbps``) through its NIC
   (``--nic-gbps``) with the code the KeysManager uses (``keysmanager.registry.ModelRegistry.fetch``:
   streamed, sha256-verified). Target: ≥ 0.8 × the NIC rate.
2. ``cross_host``: ``quartctl up --network netns`` with an emulated 3-stage pipeline, replicas spread over
   the hosts; requests through the gateway (root namespace) cross the bridge to every stage.
3. ``host_failure``: open-loop load (``--rate`` req/s for ``--duration`` s); at ``--down-at`` s the host
   holding most replicas loses its link. Every request is answered (ok or an explicit error) or lost (no
   answer); ``recovered_s`` is the time from the link going down until every stage again has its desired
   replicas ready on live hosts. Targets: lost = 0, recovered within 5 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from quart_provider.network import HostNetwork, cluster_id, unavailable_reason
from quart_stage import cliargs
from quart_tools.arrivals import poisson_arrivals
from quart_tools.bench import free_port, machine_info, wait_tcp, write_random_file, write_report
from quart_tools.bench.policies import Gateway
from quart_tools.loadgen import run_load

MODEL = "bert-21b"  # emulated: its profile, no weights
STAGES = 3


def registry_fetch(nic_gbps: float, registry_gbps: float, stage_bytes: int, work: Path) -> dict:
    """One host fetches ``stage_bytes`` from the registry namespace; bytes, seconds, Gbit/s."""
    from keysmanager.registry import ModelRegistry

    net = HostNetwork.create(["host-0", "registry"], cluster_id(f"bench-reg-{os.getpid()}"), nic_gbps)
    server = None
    try:
        net.set_rate("registry", registry_gbps)
        reg = net.host("registry")
        port = free_port()
        server = subprocess.Popen(net.exec_argv(reg, [sys.executable, "-m", "moto.server", "-H", reg.address,
                                                      "-p", str(port)]),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_tcp(reg.address, port)
        endpoint = f"http://{reg.address}:{port}"
        creds = work / "registry-credentials"
        creds.write_text("[default]\naws_access_key_id = bench\naws_secret_access_key = bench-secret\n")
        creds.chmod(0o600)
        env = {**os.environ, "AWS_SHARED_CREDENTIALS_FILE": str(creds), "QUART_REGISTRY_ENDPOINT": endpoint}
        os.environ.update({k: env[k] for k in ("AWS_SHARED_CREDENTIALS_FILE", "QUART_REGISTRY_ENDPOINT")})
        blob = work / "stage.bin"
        sha256 = write_random_file(blob, stage_bytes)
        size = blob.stat().st_size
        registry = ModelRegistry("s3://models/bench", endpoint_url=endpoint)
        registry._ensure_bucket()
        registry.client.upload_file(str(blob), "models", registry.key("stage.bin"))
        blob.unlink()
        code = ("import json,sys; from pathlib import Path; from keysmanager.registry import ModelRegistry; "
                "r = ModelRegistry('s3://models/bench').fetch('stage.bin', Path(sys.argv[1]), sys.argv[2], "
                "int(sys.argv[3])); Path(sys.argv[1]).unlink(); print(json.dumps([r.nbytes, r.seconds]))")
        dest = Path("/dev/shm") / f"quart-bench-fetch-{os.getpid()}"
        done = subprocess.run(net.exec_argv("host-0", [sys.executable, "-c", code, str(dest), sha256,
                                                       str(size)]),
                              env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"fetch in host-0 failed: {done.stderr.strip()[-500:]}")
        nbytes, seconds = json.loads(done.stdout.strip().splitlines()[-1])
        gbps = 8 * nbytes / seconds / 1e9
        return {"bytes": nbytes, "seconds": round(seconds, 3), "gbps": round(gbps, 3),
                "fraction_of_nic": round(gbps / nic_gbps, 3), "registry_gbps": registry_gbps}
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        net.destroy()


def _stack(work: Path, replicas: int) -> Path:
    out = work / "model"
    done = subprocess.run([sys.executable, "-m", "quart_tools.cli", "partition", "--model", MODEL, "--stages",
                           str(STAGES), "--out", str(out), "--compute", "emulated", "--emulated-mean-ms", "20",
                           "--scale-min", str(replicas), "--scale-max", str(replicas)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"partition failed: {done.stderr.strip()[-500:]}")
    return out / "stack.yml"


def _stages(gw: Gateway) -> dict[str, dict]:
    return {name: fn for name, fn in gw.functions().items() if name.startswith(f"{MODEL}-stage-")}


def _replica_hosts(gw: Gateway) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in _stages(gw):
        res = requests.get(f"{gw.url}/system/replicas/{name}", auth=gw.auth, timeout=10)
        res.raise_for_status()
        for rep in res.json()["replicas"]:
            if rep.get("state") == "ready":
                counts[rep["host"]] = counts.get(rep["host"], 0) + 1
    return counts


def _all_ready(gw: Gateway, dead_host: str) -> bool:
    stages = _stages(gw)
    if len(stages) < STAGES or any(fn["availableReplicas"] < fn["replicas"] for fn in stages.values()):
        return False
    return dead_host not in _replica_hosts(gw)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def cluster(args, work: Path) -> tuple[dict, dict]:
    """cross_host and host_failure on one `quartctl up --network netns` cluster."""
    stack = _stack(work, args.replicas)
    gw = Gateway(stack, work / "state", args.hosts, args.gpus_per_host, {"QUART_POLICY": "static",
                                                                        "QUART_CONTROL_PERIOD_S": "1"},
                 extra=("--network", "netns", "--nic-gbps", str(args.nic_gbps)))
    url = f"{gw.url}/function/{MODEL}"
    body = {"input_ids": [[1, 2, 3, 4]]}
    try:
        _wait(lambda: len(_stages(gw)) == STAGES and all(
            fn["availableReplicas"] >= fn["replicas"] for fn in _stages(gw).values()), 120, "every replica ready")
        spread = _replica_hosts(gw)
        oks = sum(requests.post(url, json=body, timeout=30).status_code == 200 for _ in range(args.cross_requests))
        cross = {"requests": args.cross_requests, "ok": oks, "replicas_by_host": spread}
        victim = max(spread, key=spread.get)
        arrivals = poisson_arrivals(args.rate, args.duration, seed=1)
        downed: dict[str, float] = {}

        def take_down() -> None:
            time.sleep(args.down_at)
            downed["at"] = time.monotonic()
            subprocess.run([sys.executable, "-m", "quart_tools.cli", "host", "down", victim, "--state-dir",
                            str(work / "state")], check=True, capture_output=True, timeout=30)
            _wait(lambda: _all_ready(gw, victim), 60, "every stage back at its replicas")
            downed["recovered"] = time.monotonic()

        killer = threading.Thread(target=take_down, daemon=True)
        killer.start()
        result = asyncio.run(run_load(url, arrivals, timeout_s=args.request_timeout, progress=False,
                                      body=lambda _size: (json.dumps(body).encode(), "application/json")))
        killer.join(90)
        records = result.records
        failure = {
            "host": victim, "sent": len(records), "ok": sum(r.ok for r in records),
            "explicit_error": sum(1 for r in records if r.status >= 400),
            "lost": sum(1 for r in records if r.status == 0),
            "errors": sorted({f"{r.status} {r.error or ''}".strip() for r in records if not r.ok})[:10],
            "recovered_s": round(downed["recovered"] - downed["at"], 2) if "recovered" in downed else None,
        }
        subprocess.run([sys.executable, "-m", "quart_tools.cli", "host", "up", victim, "--state-dir",
                        str(work / "state")], capture_output=True, timeout=30)
        return cross, failure
    finally:
        gw.close()


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--gpus-per-host", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2, help="replicas of every stage (static)")
    p.add_argument("--nic-gbps", type=float, default=1.0)
    p.add_argument("--registry-gbps", type=float, default=10.0, help="the registry's own NIC")
    p.add_argument("--stage-gb", type=float, default=1.0)
    p.add_argument("--cross-requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--down-at", type=float, default=10.0)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--skip-fetch", action="store_true", help="leave out the registry measurement")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"quartctl bench hosts: {reason}", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="quart-bench-hosts-") as tmp:
        work = Path(tmp)
        fetch = None if args.skip_fetch else registry_fetch(args.nic_gbps, args.registry_gbps,
                                                            int(args.stage_gb * 1e9), work)
        cross, failure = cluster(args, work)
    doc = {"hosts": args.hosts, "nic_gbps": args.nic_gbps, "registry_fetch": fetch, "cross_host": cross,
           "host_failure": failure, "wall_s": round(time.time() - started, 1),
           "machine": machine_info(load_avg=os.getloadavg()[0]), "command": "quartctl bench hosts " + " ".join(argv)}
    write_report(doc, args.out)
    return 0

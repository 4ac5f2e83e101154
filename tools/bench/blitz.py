"""`quartctl bench blitz [--out FILE]`: a stage to k hosts at once from one holder (BlitzScale §5.1).

Hosts are network namespaces with tbf-limited NICs (``--nic-gbps``, default 1); a KeysManager runs in each,
on TCP with the cluster's token; the model registry (moto's S3 server) listens on the bridge in the root
namespace and holds one synthetic stage of ``--stage-mb`` random bytes. The source host fetches the stage
from the registry first; then, timed from the first order to the last receiver holding verified bytes:

- ``one_transfer_s``: one receiver fetches from the source (``peers=[source]``);
- ``star_last_ready_s``: ``--receivers`` k hosts each fetch from the source at once (the source sends k
  times: bound by its NIC, ≈ k × one transfer);
- ``chain_last_ready_s``: the planner's chain (``quart_kernel.scheduling.multicast.plan_chain``): each
  receiver is told, in chain order, to fetch from its predecessor, which forwards every chunk while it writes
  it (≈ one transfer + (k − 1) chunk times).

Each figure is the median of ``--reps`` rounds (every sample is in ``samples_s``). Every run uses fresh receivers (restarted, state dirs emptied, the registry client warmed: one manifest
read) and removes its namespaces at the end. Ready times are the KeysManagers' own timestamps
(``finished_at``: the verified file renamed into place), read every 50 ms.
:class:`PeerCluster` is also the harness of ``tests/e2e/test_peer_fetch.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from quart_kernel.scheduling.multicast import plan_chain
from quart_provider.network import HostNetwork, cleanup_by_prefix, cluster_id
from quart_stage import cliargs
from quart_tools.bench import free_port, machine_info, wait_tcp, write_random_file, write_report

from keysmanager.client import KeysManagerClient, KeysManagerError
from keysmanager.registry import ModelRegistry
from keysmanager.transfer import sha256_file
from keysmanager.types import StageSpec

PORT = 7077
FUNCTION = "blitz-stage-0"
MODEL_URL = "s3://models/blitz"
TOKEN = "blitz-token-" + "x" * 24


@dataclass
class PeerCluster:
    """Namespaced hosts, a KeysManager on each (TCP, token), a registry on the bridge holding one stage."""

    net: HostNetwork
    work: Path
    endpoint: str = ""
    stage: Path | None = None  # the stage's bytes as uploaded (for equality checks)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    preload: bool = False  # KeysManagers with the preloader (imports done once; zygotes fork from it)
    km_args: tuple[str, ...] = ()  # more KeysManager flags (e.g. --gpus for the gateway's placer)

    @property
    def registry_root(self) -> Path:
        """The folder a files registry (``quart_tools.bench.s3files``) serves: one folder per bucket."""
        return self.work / "s3"

    @property
    def spec(self) -> StageSpec:
        return StageSpec(FUNCTION, env={"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "0"})

    def url(self, host: str) -> str:
        return f"http://{self.net.host(host).address}:{PORT}"

    def client(self, host: str, token: str = TOKEN, timeout: float = 30.0) -> KeysManagerClient:
        return KeysManagerClient(self.url(host), timeout=timeout, token=token)

    def state_dir(self, host: str) -> Path:
        return self.work / f"{host}-state"

    def token_file(self, token: str = TOKEN) -> Path:
        path = self.work / f"token-{hashlib.sha256(token.encode()).hexdigest()[:8]}"
        path.write_text(token + "\n")
        path.chmod(0o600)
        return path

    def env(self) -> dict[str, str]:
        creds = self.work / "aws-credentials"
        creds.write_text("[default]\naws_access_key_id = blitz\naws_secret_access_key = blitz-secret\n")
        creds.chmod(0o600)
        return {**os.environ, "AWS_SHARED_CREDENTIALS_FILE": str(creds), "QUART_REGISTRY_ENDPOINT": self.endpoint,
                "KM_PRELOAD": "true" if self.preload else "false"}

    def start_km(self, host: str, token: str = TOKEN) -> None:
        """A KeysManager in ``host``'s namespace (fresh state dir), listening on its address."""
        shutil.rmtree(self.state_dir(host), ignore_errors=True)
        address = self.net.host(host).address
        argv = [sys.executable, "-m", "keysmanager.daemon", "--name", host, "--socket",
                str(self.work / f"{host}.sock"), "--state-dir", str(self.state_dir(host)), "--listen",
                f"{address}:{PORT}", "--token-file", str(self.token_file(token)), "--host-address", address,
                *self.km_args]
        log = open(self.work / f"{host}.log", "ab")  # noqa: SIM115 - the child owns it
        self.procs[host] = subprocess.Popen(self.net.exec_argv(host, argv), env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client(host, token, timeout=2).health()
                return
            except (KeysManagerError, OSError):
                if self.procs[host].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"KeysManager {host} did not start: "
                                       f"{(self.work / f'{host}.log').read_text()[-2000:]}") from None
                time.sleep(0.1)

    def cpu_s(self, hosts: list[str]) -> dict[str, float]:
        """CPU seconds (user + system, every thread) each host's KeysManager process has used so far: a receiver's
        transfer and its forwarding run there (replicas and zygotes are processes of their own)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for h in hosts:
            with contextlib.suppress(OSError, KeyError, IndexError, ValueError):
                fields = Path(f"/proc/{self.procs[h].pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[h] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
        return out

    def kill(self, host: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(host, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def upload_stage(self, nbytes: int) -> None:
        """A synthetic one-stage model of ``nbytes`` random bytes in the registry (the manifest last)."""
        folder = self.work / "model"
        folder.mkdir(exist_ok=True)
        self.stage = folder / "stage-0.safetensors"
        sha256 = write_random_file(self.stage, nbytes)
        manifest = {"model": "blitz", "stages": [{"index": 0, "file": self.stage.name, "sha256": sha256,
                                                  "file_bytes": nbytes}]}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        ModelRegistry(MODEL_URL, endpoint_url=self.endpoint).upload(folder)

    def held_file(self, host: str) -> Path:
        """The stage file as it landed on ``host``."""
        [path] = (self.state_dir(host) / "registry").glob(f"*-0/{self.stage.name}")
        return path

    def wait_held(self, hosts: list[str], timeout_s: float = 120.0, since: float | None = None) -> dict[str, float]:
        """Seconds from ``since`` (wall clock; default now) until each host had the stage's verified file in
        place (its KeysManager's own timestamp: the namespaces share the clock); RuntimeError on timeout."""
        since = time.time() if since is None else since
        ready: dict[str, float] = {}
        clients = {h: self.client(h) for h in hosts}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(hosts):
            for h in hosts:
                status = clients[h].stage(FUNCTION) if h not in ready else {}
                if status.get("state") == "held" and "finished_at" in status:
                    ready[h] = status["finished_at"] - since
            if time.monotonic() > deadline:
                raise RuntimeError(f"not held after {timeout_s} s: {sorted(set(hosts) - set(ready))}")
            time.sleep(0.05)
        return ready


@contextlib.contextmanager
def peer_cluster(hosts: list[str], nic_gbps: float, key: str, registry_gbps: float | None = None,
                 files_registry: bool = False) -> Iterator[PeerCluster]:
    """A :class:`PeerCluster`; everything it made (processes, namespaces, files) is removed at exit. The registry
    listens on the bridge in the root namespace, or with ``registry_gbps`` in a namespace of its own behind a
    link of that rate (a store slower than the hosts' fabric, as BlitzScale's SSDs and remote storage are).
    ``files_registry`` (with ``registry_gbps``): that registry is ``quart_tools.bench.s3files`` over
    ``cluster.registry_root`` (ranged reads at line rate; the caller places the model there), not moto."""
    from moto.server import ThreadedMotoServer

    cid = cluster_id(key)
    work = Path(tempfile.mkdtemp(prefix="blitz-", dir="/dev/shm"))  # host memory, as a cache is: no disk writeback
    server = None
    cluster = None
    saved = os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
    try:
        net = HostNetwork.create([*hosts, "registry"] if registry_gbps else hosts, cid, nic_gbps)
        cluster = PeerCluster(net, work)
        if registry_gbps:
            net.set_rate("registry", registry_gbps)
            reg = net.host("registry")
            port = free_port()
            server_argv = ["-m", "moto.server", "-H", reg.address, "-p", str(port)]
            if files_registry:
                cluster.registry_root.mkdir()
                server_argv = ["-m", "quart_tools.bench.s3files", "--root", str(cluster.registry_root),
                               "--host", reg.address, "--port", str(port)]
            cluster.procs["registry"] = subprocess.Popen(
                net.exec_argv(reg, [sys.executable, *server_argv]),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            cluster.endpoint = f"http://{reg.address}:{port}"
            wait_tcp(reg.address, port)
        else:
            server = ThreadedMotoServer(ip_address=net.bridge_address, port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            cluster.endpoint = f"http://{host}:{port}"
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = cluster.env()["AWS_SHARED_CREDENTIALS_FILE"]
        yield cluster
    finally:
        if cluster is not None:
            for h in list(cluster.procs):
                cluster.kill(h, signal.SIGTERM)
        if server is not None:
            server.stop()
        cleanup_by_prefix(cid)
        shutil.rmtree(work, ignore_errors=True)
        if saved is None:
            os.environ.pop("AWS_SHARED_CREDENTIALS_FILE", None)
        else:
            os.environ["AWS_SHARED_CREDENTIALS_FILE"] = saved


WARM_ZYGOTE = {"QUART_PROFILE": "bert-21b", "QUART_NUM_STAGES": "8", "QUART_STAGE_INDEX": "0",
               "QUART_COMPUTE": "emulated", "QUART_EMULATED_MEAN_MS": "1", "QUART_EMULATED_CV": "0"}


def fresh_keysmanagers(cluster: PeerCluster, hosts: list[str], preloader: bool = False, warm: bool = False) -> None:
    """Restarted KeysManagers (nothing held), warmed: each has read the manifest once (boto3 imported, its
    registry client made) through a start of a stage index the model lacks, answered 502; with ``preloader``,
    each has its preloader up too (a parameter-free zygote cached: torch imported once, as on a host that
    serves stages, before any cold start); with ``warm``, each preloader has imported every family's model code
    as well (``GET /v1/health``: ``preloader`` is ``warm``), as on a host that has been up a while; a KeysManager
    with a landing reserve (``--landing-mb``) has filled it, as it does after it starts."""
    warm = StageSpec("warm-up", env={"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "9"})
    for h in hosts:
        cluster.kill(h, signal.SIGTERM)
        cluster.start_km(h)
    for h in hosts:
        client = cluster.client(h, timeout=300)
        with contextlib.suppress(KeysManagerError):
            client.ensure_cached(warm)
        if preloader:
            client.ensure_cached(StageSpec("warm-zygote", env=WARM_ZYGOTE))
    deadline = time.monotonic() + 300
    while any(_starting(cluster.client(h).health(), warm) for h in hosts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the preloaders of {hosts} did not import the model code (or the landing reserves "
                               "did not fill) within 300 s")
        time.sleep(0.5)


def _starting(health: dict, warm: bool) -> bool:
    """Whether a KeysManager is still doing its start-up work: the preloader's imports (``warm``), the reserve."""
    return (warm and health.get("preloader") != "warm") or health.get("landing", {}).get("state") == "filling"


def measure(stage_mb: int, nic_gbps: float, receivers: int, reps: int = 3) -> dict:
    """Medians over ``reps`` rounds of one / star / chain (every receiver's bytes compared with the stage)."""
    names = ["source", *(f"r{i}" for i in range(receivers))]
    with peer_cluster(names, nic_gbps, f"bench-blitz-{os.getpid()}") as cluster:
        cluster.upload_stage(stage_mb << 20)
        for h in names:
            cluster.start_km(h)
        cluster.client("source").prefetch(cluster.spec)
        cluster.wait_held(["source"])
        source, targets = cluster.url("source"), names[1:]

        def run(orders: list[tuple[str, list[str]]]) -> float:
            fresh_keysmanagers(cluster, [h for h, _ in orders])
            start = time.time()
            for h, peers in orders:  # in order: each is registered before the next asks it
                cluster.client(h).prefetch(cluster.spec, peers)
            return max(cluster.wait_held([h for h, _ in orders], since=start).values())

        chain = plan_chain(["source"], targets, busy_links=set())
        orders = {"one": [(targets[0], [source])], "star": [(h, [source]) for h in targets],
                  "chain": [(h, [cluster.url(prev), source]) for prev, h in zip(chain, chain[1:], strict=False)]}
        samples: dict[str, list[float]] = {mode: [] for mode in orders}
        for _ in range(reps):
            for mode, order in orders.items():
                samples[mode].append(round(run(order), 3))
                if not all(_same(cluster.held_file(h), cluster.stage) for h, _ in order):
                    raise RuntimeError(f"{mode}: a receiver's bytes differ from the stage's")
    one, star, chain_s = (statistics.median(samples[m]) for m in ("one", "star", "chain"))
    return {"stage_bytes": stage_mb << 20, "nic_gbps": nic_gbps, "receivers": receivers,
            "one_transfer_s": one, "star_last_ready_s": star, "chain_last_ready_s": chain_s, "chain": chain,
            "bytes_equal": True, "reps": reps, "samples_s": samples,
            "chain_over_one": round(chain_s / one, 3), "star_over_one": round(star / one, 3),
            "line_rate_s": round(8 * (stage_mb << 20) / (nic_gbps * 1e9), 3)}


def _same(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and sha256_file(a) == sha256_file(b)


def main(argv: list[str]) -> int:
    parser = cliargs.ArgumentParser(prog="quartctl bench blitz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here (default stdout)")
    parser.add_argument("--stage-mb", type=int, default=200, help="stage size, MiB (default 200)")
    parser.add_argument("--nic-gbps", type=float, default=1.0, help="each host's NIC limit (default 1)")
    parser.add_argument("--receivers", type=int, default=3, help="hosts that need the stage at once (default 3)")
    parser.add_argument("--reps", type=int, default=3, help="rounds of the three modes; medians reported (default 3)")
    args = parser.parse_args(argv)
    doc = measure(args.stage_mb, args.nic_gbps, args.receivers, args.reps)
    doc["machine"] = machine_info(load_avg_1m_at_start=round(os.getloadavg()[0], 2), work_dir="/dev/shm (tmpfs)")
    doc["command"] = "quartctl bench blitz " + " ".join(argv)
    write_report(doc, args.out)
    return 0

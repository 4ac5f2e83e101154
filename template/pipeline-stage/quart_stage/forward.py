"""A stage pod's fork path: the node's KeysManager forks the replica, this pod forwards to it.

``python -m quart_stage.forward`` is the pod's start command in fork mode (of-watchdog's ``fprocess``, set by
deploy/kubernetes' admission policy). It imports no torch (stdlib and quart_stage's lean modules only):

1. ``POST /v1/cache`` then ``POST /v1/replicas {"listen": "unix", "wait": false, "lease_within_s": 30}`` on the
   node's KeysManager
   (``QUART_KEYSMANAGER_SOCKET``) with this pod's own stage spec and ``QUART_*`` environment: the KeysManager's
   normal start path, a fork of the stage's zygote (19-49 ms), serving on a Unix socket in the mounted socket
   folder;
2. ``POST /v1/replicas/{id}/lease`` with a body it never ends: when this process exits, even by SIGKILL, the
   kernel closes that connection and the KeysManager stops the replica. The pod's lifetime owns the replica's;
3. polls the replica's ``GET /_/health`` over its socket, then listens on ``QUART_BIND`` (127.0.0.1:5000,
   of-watchdog's upstream) and forwards every request to it (``quart_stage.proxy``): ``/_/health`` answers only
   from then on, and only while the replica answers;
4. on SIGTERM (or SIGINT): stops accepting, asks the KeysManager to stop the replica (it drains its requests in
   flight), lets the last answers out, exits 0. When the replica ends by itself (the lease answers) or the
   KeysManager goes away, it exits 1: the container restarts and takes a start path again.

When no KeysManager answers, or it cannot start the replica, or the stage is a cuda stage (the replica would run
in the KeysManager's pod, which holds none of this pod's GPUs), it logs why and execs ``gunicorn index:app``:
the attach path (``quart_stage.attach``: map the node's segment), which itself falls back to the cold load.
Which path was taken: the log line ``start path ...``, the header ``X-Quart-Start: fork`` on every forwarded
answer and ``"start": "fork"`` in the health answer (the gunicorn paths answer ``"parameters": "node-cache"`` or
``"memory"``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from quart_stage.config import StageConfig
from quart_stage.nodecache import NodeCacheError, km_call, stage_spec
from quart_stage.proxy import Upstream, serve
from quart_stage.settings import ConfigError, setting, settings_from_env
from quart_stage.unixhttp import UnixHTTPConnection

GUNICORN = ("-m", "gunicorn", "index:app", "--config", "gunicorn.conf.py")
log = logging.getLogger("quart_stage.forward")


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    """``QUART_FORWARD_*`` (and ``QUART_BIND``): how the fork path forwards.

    timeout_s        [QUART_FORWARD_TIMEOUT_S]        the replica's answer to one request (504 after), default 300
    idle_s           [QUART_FORWARD_IDLE_S]           a client keep-alive connection's idle time, default 75
    ready_timeout_s  [QUART_FORWARD_READY_TIMEOUT_S]  the forked replica's first healthy answer, default 180
    bind             [QUART_BIND]                     where to listen (of-watchdog's upstream_url), 127.0.0.1:5000
    """

    timeout_s: float = 300.0
    idle_s: float = 75.0
    ready_timeout_s: float = 180.0
    bind: str = "127.0.0.1:5000"

    def __post_init__(self) -> None:
        for name in ("timeout_s", "idle_s", "ready_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"QUART_FORWARD_{name.upper()} must be > 0, got {getattr(self, name)}")
        host, _, port = self.bind.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"QUART_BIND must be HOST:PORT, got {self.bind!r}")

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.bind.rpartition(":")
        return host, int(port)

    @classmethod
    def from_env(cls, env=None) -> ForwardSettings:
        return settings_from_env(cls, "QUART_FORWARD_", env, names={"bind": "QUART_BIND"})


@dataclass(slots=True)
class ForkedReplica:
    """The replica forked for this pod: its id, its socket, the lease that ties it to this process."""

    km_socket: str
    replica_id: str
    socket: str
    lease: socket.socket
    timings_ms: dict[str, float] = field(default_factory=dict)


def why_not_fork(cfg: StageConfig) -> str | None:
    """Why this pod cannot take the fork path (None: it can try)."""
    if not cfg.keysmanager_socket:
        return "QUART_KEYSMANAGER_SOCKET is not set: no node KeysManager is mounted"
    if cfg.compute == "cuda":
        return "a cuda stage: a replica forked in the KeysManager's pod would not see this pod's GPU"
    return None


def open_lease(km_socket: str, replica_id: str) -> socket.socket:
    """``POST /v1/replicas/{id}/lease`` with a chunked body never ended: the KeysManager stops the replica when
    this connection closes, and answers on it when the replica ends first."""
    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lease.connect(km_socket)
    lease.sendall(f"POST /v1/replicas/{replica_id}/lease HTTP/1.1\r\nHost: localhost\r\n"
                  "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    return lease


def stop_replica(km_socket: str, replica_id: str, timeout_s: float = 60.0) -> None:
    """The KeysManager's stop (drain): returns once the replica is dead; errors are logged, not raised."""
    try:
        km_call(km_socket, "POST", f"/v1/replicas/{replica_id}/stop", {"drain": True}, timeout_s)
    except NodeCacheError as exc:
        log.warning("stopping replica %s: %s (the lease still stops it when this process exits)", replica_id, exc)


def wait_ready(rep: ForkedReplica, timeout_s: float) -> None:
    """Poll the replica's ``/_/health`` on its socket every 5 ms until 200; NodeCacheError when it ends first."""
    deadline = time.monotonic() + timeout_s
    rep.lease.setblocking(False)
    try:
        while time.monotonic() < deadline:
            try:
                rep.lease.recv(1, socket.MSG_PEEK)  # returns once the KeysManager answers (or closes)
                raise NodeCacheError(f"the forked replica {rep.replica_id} ended before it was ready")
            except BlockingIOError:
                pass  # nothing to read: the lease holds
            conn = UnixHTTPConnection(rep.socket, 5.0)
            try:
                conn.request("GET", "/_/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.005)
    finally:
        rep.lease.setblocking(True)
    raise NodeCacheError(f"the forked replica {rep.replica_id} was not ready within {timeout_s:g} s")


def fork_replica(cfg: StageConfig, settings: ForwardSettings) -> ForkedReplica:
    """Ask the node's KeysManager to cache the stage and fork a replica on a Unix socket; lease it, wait until
    it is healthy. Raises NodeCacheError (nothing is left running then)."""
    sock, spec, timeout = cfg.keysmanager_socket, stage_spec(cfg), cfg.keysmanager_timeout_s
    t0 = time.perf_counter()
    km_call(sock, "POST", "/v1/cache", {"spec": spec}, timeout)
    t1 = time.perf_counter()
    start = {"spec": spec, "count": 1, "wait": False, "listen": "unix", "lease_within_s": 30}
    answer = km_call(sock, "POST", "/v1/replicas", start, timeout)
    [info] = answer["replicas"]
    if not info.get("socket"):
        stop_replica(sock, info["id"])
        raise NodeCacheError("the KeysManager started the replica on TCP, not on a Unix socket (too old for listen)")
    try:
        rep = ForkedReplica(sock, info["id"], info["socket"], open_lease(sock, info["id"]))
    except OSError as exc:
        stop_replica(sock, info["id"])
        raise NodeCacheError(f"cannot lease replica {info['id']}: {exc}") from None
    t2 = time.perf_counter()
    try:
        wait_ready(rep, settings.ready_timeout_s)
    except BaseException:
        stop_replica(sock, rep.replica_id)
        rep.lease.close()
        raise
    rep.timings_ms = {"cache": (t1 - t0) * 1e3, "fork": (t2 - t1) * 1e3, "ready": (time.perf_counter() - t2) * 1e3}
    return rep


def exec_fallback(why: str, stage_index: int | str) -> None:
    """Become ``gunicorn index:app`` (the attach path, then the cold load). Never returns."""
    log.warning("stage %s: start path attach/cold (gunicorn index:app): not forked on the node: %s", stage_index, why)
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, *GUNICORN])


def run(rep: ForkedReplica, settings: ForwardSettings, stage_index: int) -> int:
    """Forward to ``rep`` until SIGTERM/SIGINT (0) or the replica's end (1); stops the replica either way."""
    server = serve(settings.address, Upstream(rep.socket, rep.replica_id, settings.timeout_s), settings.idle_s)
    log.info("stage %d: start path fork: replica %s forked by the node's KeysManager (cache %.1f ms, fork %.1f ms, "
             "ready %.1f ms); forwarding %s -> %s", stage_index, rep.replica_id, rep.timings_ms["cache"],
             rep.timings_ms["fork"], rep.timings_ms["ready"], settings.bind, rep.socket)
    stop = threading.Event()
    ended = threading.Event()

    def watch_lease() -> None:
        try:
            rep.lease.recv(1)  # blocks: an answer (the replica ended) or EOF (the KeysManager went away)
        except OSError:
            pass
        if not stop.is_set():
            ended.set()
            stop.set()

    def on_signal(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=watch_lease, daemon=True, name="lease").start()
    while not stop.wait(0.5):
        pass
    server.shutdown()  # no new requests from now on
    if ended.is_set():
        log.error("stage %d: the forked replica %s ended or the KeysManager went away: exiting", stage_index,
                  rep.replica_id)
    else:
        log.info("stage %d: stopping the forked replica %s", stage_index, rep.replica_id)
        stop_replica(rep.km_socket, rep.replica_id)  # drains: the requests in flight are answered
    deadline = time.monotonic() + 5.0
    while server.in_flight and time.monotonic() < deadline:  # the last answers leave this process
        time.sleep(0.01)
    rep.lease.close()
    server.server_close()
    return 1 if ended.is_set() else 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg, settings = StageConfig.from_env(), ForwardSettings.from_env()
    except ConfigError as exc:
        exec_fallback(f"bad settings ({exc})", setting("QUART_STAGE_INDEX", str, "?"))
    why = why_not_fork(cfg)
    rep = None
    if why is None:
        try:
            rep = fork_replica(cfg, settings)
        except (NodeCacheError, OSError, KeyError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    if rep is None:
        exec_fallback(why or "unknown", cfg.stage_index)
    return run(rep, settings, cfg.stage_index)


if __name__ == "__main__":
    sys.exit(main())

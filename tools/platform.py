"""`quartctl up`, `quartctl down`, `quartctl host`, `quartctl deploy`: the composition root that runs the platform
(`quart_provider`) with the gateway plugin attached, and deploys to it.

    quartctl up [-f stack.yml] [--port 8080] [--hosts H --gpus-per-host G --host-memory M] [--placer NAME]
                [--network loopback|netns [--nic-gbps G]] [--state-dir .quart] [--detach]
    quartctl down [--state-dir .quart]
    quartctl host down|up NAME [--state-dir .quart]
    quartctl deploy -f stack.yml [--gateway URL] [--password-stdin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from quart_kernel.scheduling import PLACERS
from quart_provider.config import NETWORKS, GatewayConfig
from quart_provider.network import (
    DEFAULT_NIC_GBPS,
    HostNetwork,
    NetworkError,
    cleanup_by_prefix,
    unavailable_reason,
)
from quart_provider.stack import StackError, load_stack
from quart_provider.system import STATE_FILE, EmbeddedSystem, PluginAttach, _alive, stop_process
from quart_stage import cliargs
from quart_stage.errors import QuartError
from quart_stage.logs import configure as configure_logs
from quart_stage.settings import ConfigError
from quart_tools.readiness import READY_PREFIX, keep_only, readiness_lines, wait_settled
from quart_transport.quantities import parse_memory

from keysmanager.config import KeysManagerConfig
from keysmanager.recovery import clean_leftovers

DEFAULT_STATE_DIR = Path(".quart")
# replica slots of `quartctl up`'s host: the README's walkthrough (4 stages, then `quartctl load` at 10 req/s)
# leaves the autoscaler room for several replicas per stage (GatewayConfig's own default, 4, is for tests)
UP_SLOTS = 16


def _state(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _up_parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl up", description="Start the embedded OpenFaaS-compatible gateway, "
                                "one KeysManager per simulated host, and the gateway plugin.")
    p.add_argument("-f", "--file", "--yaml", dest="file", help="stack.yml to deploy once the gateway is up")
    p.add_argument("--port", type=cliargs.port, default=None, help="gateway port (default 8080; 0 = any free port)")
    p.add_argument("--provider-port", type=cliargs.port, default=None,
                   help="also serve the faas-provider API here, for a real OpenFaaS gateway in front (0 = any port)")
    p.add_argument("--bind", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--hosts", type=cliargs.positive_int, default=None,
                   help="simulated hosts, one KeysManager each (default 1)")
    p.add_argument("--gpus-per-host", type=cliargs.positive_int, default=None,
                   help=f"replica slots per host (default {UP_SLOTS}: room for the autoscaler to scale the stages)")
    p.add_argument("--host-memory", type=_memory, default=None, help="parameter cache per host, e.g. 8Gi (default 8Gi)")
    p.add_argument("--placer", choices=PLACERS, default=None, help="replica placer (default cache-aware)")
    p.add_argument("--network", choices=NETWORKS, default=None,
                   help="loopback (default): KeysManagers on Unix sockets, replicas on 127.0.0.1; netns: each "
                        "host a network namespace on a bridge, KeysManager on TCP with a token (needs root)")
    p.add_argument("--nic-gbps", type=float, default=None,
                   help=f"netns: each host's NIC limit in Gbit/s, both directions (default {DEFAULT_NIC_GBPS})")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="credentials, sockets, logs (.quart)")
    p.add_argument("--no-plugin", action="store_true", help="do not attach gateway_plugin.plugin")
    p.add_argument("--process-hosts", action="store_true",
                   help="hosts without KeysManagers: only process runnables (quart/echo) can run")
    p.add_argument("--keep-hosts", action=argparse.BooleanOptionalAction, default=True,
                   help="KeysManagers and their replicas outlive this gateway (the default on loopback, as function "
                        "pods outlive OpenFaaS's gateway); the next `quartctl up` on the same --state-dir adopts them "
                        "instead of starting every replica again. `quartctl down` stops everything; --no-keep-hosts: "
                        "stopping the gateway stops its hosts too")
    p.add_argument("--detach", "-d", action="store_true", help="run in the background; stop with `quartctl down`")
    p.add_argument("--wait", type=float, default=120.0,
                   help="seconds to wait for the functions' replicas before reporting each one (default 120)")
    return p


def _config(args: argparse.Namespace) -> GatewayConfig:
    slots = args.gpus_per_host
    if slots is None and not os.environ.get("QUART_GATEWAY_GPUS_PER_HOST"):
        slots = UP_SLOTS
    return GatewayConfig.from_env(
        port=args.port, provider_port=args.provider_port, bind=args.bind, hosts=args.hosts, gpus_per_host=slots,
        host_memory_bytes=args.host_memory, placer=args.placer, state_dir=args.state_dir.resolve(),
        network=args.network, nic_gbps=args.nic_gbps,
    )


def up(argv: list[str]) -> int:
    args = _up_parser().parse_args(argv)
    state_dir = args.state_dir.resolve()
    running = _state(state_dir)
    if running and _alive(int(running.get("pid", 0))):
        print(f"quartctl up: already running (pid {running['pid']}) at {running['url']}; stop it with "
              f"`quartctl down --state-dir {args.state_dir}`", file=sys.stderr)
        return 1
    stack = None
    if args.file:
        try:
            stack = load_stack(args.file)
        except StackError as exc:
            print(f"quartctl up: {exc}", file=sys.stderr)
            return 2
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"quartctl up: {exc}", file=sys.stderr)
        return 2
    if config.network == "netns" and (reason := unavailable_reason()):
        print(f"quartctl up: --network netns: {reason}", file=sys.stderr)
        return 2
    if args.detach:
        return _detach(argv, state_dir, args.wait)
    try:
        configure_logs()  # QUART_LOG_LEVEL, QUART_LOG_FORMAT (text or json)
    except ValueError as exc:  # ConfigError: the variable and what it must be
        print(f"quartctl up: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    use_km = False if args.process_hosts else None
    return asyncio.run(_run_foreground(config, stack, not args.no_plugin, use_km, args.keep_hosts, args.wait))


def _plugin() -> PluginAttach:
    """The gateway plugin's attach hook: the composition root wires the plugin onto the platform (typed: wiring.py)."""
    from quart_tools.wiring import plugin_attach

    return plugin_attach()


async def _run_foreground(config: GatewayConfig, stack, attach_plugin: bool, use_keysmanager: bool | None,
                          keep_hosts: bool = False, wait_s: float = 120.0) -> int:
    system = EmbeddedSystem(config, use_keysmanager=use_keysmanager, plugin=_plugin() if attach_plugin else None,
                            hold_queue=True,  # queued async calls run once the stack's functions exist again
                            keep_hosts=keep_hosts and config.network != "netns")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await system.start()
    except (OSError, RuntimeError) as exc:  # NetworkError included
        print(f"quartctl up: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"Gateway:      {system.url}", flush=True)
        print(f"Credentials:  user {system.credentials.user}, password in {system.credentials.password_file} "
              f"(mode 0600)", flush=True)
        print(f"  faas-cli login -g {system.url} -u {system.credentials.user} --password-stdin "
              f"< {system.credentials.password_file}", flush=True)
        if system.provider_port:
            print(f"Provider API: http://{config.bind}:{system.provider_port} (functions_provider_url of an "
                  "OpenFaaS gateway)", flush=True)
        print(f"Hosts:        {config.hosts} x {config.gpus_per_host} slots, placer {config.placer}", flush=True)
        if system.network is not None:
            print(f"Network:      netns, bridge {system.network.bridge} {system.network.subnet}, NICs "
                  f"{config.nic_gbps:g} Gbit/s: " + ", ".join(f"{h.name} {h.address}" for h in system.network.hosts),
                  flush=True)
        previous = sorted(system.gateway.functions)
        if stack is not None:  # exactly this stack: what a previous run left and the stack does not name goes
            removed = await keep_only(system.gateway, (f.name for f in stack.functions))
            if removed:
                print(f"Removed {len(removed)} function(s) of the previous run on {config.state_dir} that "
                      f"{stack.path} does not name: {', '.join(removed)}", flush=True)
            try:
                for line in await system.deploy_stack(stack):
                    print(line, flush=True)
            except QuartError as exc:
                print(f"quartctl up: deploying {stack.path} failed: {exc.message}"
                      + (f" (field {exc.field})" if exc.field else ""), file=sys.stderr)
                return 1
        elif previous:
            print(f"Restored {len(previous)} function(s) of the previous run on {config.state_dir}: "
                  f"{', '.join(previous)} (`up -f stack.yml` deploys exactly a stack; `down --purge` forgets them)",
                  flush=True)
        names = sorted(system.gateway.functions)
        await wait_settled(system.gateway, names, wait_s)
        lines, not_ready = readiness_lines(system.gateway, names)
        for line in lines:
            print(line, flush=True)
        await system.start_queue_worker()
        serving = asyncio.create_task(_log_serving(system))
        if system.durable is not None and system.durable.server is not None:
            print(f"Async queue:  NATS JetStream {system.durable.server.url} (store {config.state_dir / 'nats'})",
                  flush=True)
        elif config.async_backend == "nats":
            print(f"Async queue:  unavailable, /async-function answers 503 ({system.gateway.async_unavailable})",
                  flush=True)
        if not_ready:
            print(f"Serving; {not_ready} of {len(names)} function(s) NOT READY (reasons above; `quartctl status`). "
                  "Stop with Ctrl-C or `quartctl down`.", flush=True)
        else:
            print(f"Ready: {len(names)} function(s) serving. Stop with Ctrl-C or `quartctl down`.", flush=True)
        await stop.wait()
        serving.cancel()
        return 0
    finally:
        await system.stop()


async def _log_serving(system: EmbeddedSystem) -> None:
    """Log when every function (those restored from the store included) first has its desired replicas."""
    from quart_provider.phases import process_age_s

    names = list(system.gateway.functions)
    try:
        await system.wait_ready(names, timeout_s=600)
    except (TimeoutError, KeyError):  # a function removed meanwhile, or never ready: nothing to say
        return
    logging.getLogger("quart.up").info("%d function(s) at their desired replicas %.2f s after the process started",
                                       len(names), process_age_s())


def _detach(argv: list[str], state_dir: Path, wait_s: float = 120.0) -> int:
    child_argv = [a for a in argv if a not in ("--detach", "-d")]
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    log_path = state_dir / "logs" / "gateway.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as logfile:
        process = subprocess.Popen([sys.executable, "-m", "quart_tools.cli", "up", *child_argv], stdout=logfile,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180 + wait_s  # start, deploy, then up to --wait for the replicas
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"quartctl up: the gateway exited with {process.returncode}; log: {log_path}\n"
                  + log_path.read_text(errors="replace")[-2000:], file=sys.stderr)
            return 1
        with open(log_path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        state = _state(state_dir)
        if state and state.get("pid") == process.pid and ("Ready:" in text or "Serving;" in text):
            print(f"Gateway:      {state['url']} (pid {process.pid}, log {log_path})")
            for line in text.splitlines():  # what happened to the functions, and the verdict
                if line.startswith((READY_PREFIX, "Removed ", "Restored ", "Ready:", "Serving;")):
                    print(line)
            print(f"Credentials:  user {state['user']}, password in {state['password_file']} (mode 0600)")
            print("Stop with:    quartctl down" + (f" --state-dir {state_dir}" if state_dir != DEFAULT_STATE_DIR.resolve()
                                                   else ""))
            return 0
        time.sleep(0.1)
    stop_process(process.pid, process)
    print(f"quartctl up: the gateway was not ready in 300 s; log: {log_path}", file=sys.stderr)
    return 1


def down(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl down", description="Stop everything `quartctl up` started.")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--purge", action="store_true",
                   help="also forget the deployed functions (the next `quartctl up` starts with none)")
    args = p.parse_args(argv)
    state_dir = args.state_dir.resolve()
    state = _state(state_dir)
    if state is None:
        print(f"quartctl down: nothing is running (no {state_dir / STATE_FILE})")
        return _purge(state_dir) if args.purge else 0
    pid = int(state["pid"])
    survivors: list[str] = []
    if _alive(pid) and not stop_process(pid, grace_s=30.0):
        survivors.append(f"gateway pid {pid}")
    for host in state.get("hosts", []):  # KeysManagers left behind by a killed gateway
        host_pid = int(host["pid"])
        if _alive(host_pid) and not stop_process(host_pid):
            survivors.append(f"KeysManager pid {host_pid}")
        elif host.get("socket"):  # one killed -9 leaves zygotes, replicas, /dev/shm segments and its socket; one
            # stopped leaves the replicas told to survive it (KeysManagerHost starts them so)
            found = clean_leftovers(KeysManagerConfig(name=host["name"], socket=host["socket"]))
            if found.killed or found.removed_shm:
                print(f"Cleaned after KeysManager {host['name']}: {len(found.killed)} process(es) killed, "
                      f"{len(found.removed_shm)} shared-memory segment(s) removed")
    nats = state.get("nats") or {}
    if nats.get("pid") and _alive(int(nats["pid"])) and not stop_process(int(nats["pid"])):  # a killed gateway's
        survivors.append(f"nats-server pid {nats['pid']}")
    if state.get("network"):  # the namespaces of a gateway that could not remove them itself
        removed = cleanup_by_prefix(state["network"]["cluster_id"])
        if removed:
            print(f"Removed leftovers: {', '.join(removed)}")
    if survivors:
        print(f"quartctl down: still running after SIGTERM and SIGKILL: {', '.join(survivors)} "
              f"(state kept in {state_dir / STATE_FILE})", file=sys.stderr)
        return 1
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    print(f"Stopped the gateway (pid {pid}) and {len(state.get('hosts', []))} KeysManager(s).")
    return _purge(state_dir) if args.purge else 0


def _purge(state_dir: Path) -> int:
    """Forget the functions a run deployed (``<state>/functions``); credentials and secrets stay."""
    import shutil

    from quart_provider.store import FUNCTIONS_DIR

    folder = state_dir / FUNCTIONS_DIR
    names = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    shutil.rmtree(folder, ignore_errors=True)
    print(f"Forgot {len(names)} deployed function(s)" + (f": {', '.join(names)}" if names else ""))
    return 0


def host(argv: list[str]) -> int:
    """Take a host's link down or up (netns clusters): its KeysManager and replicas stop answering."""
    p = cliargs.ArgumentParser(prog="quartctl host", description=host.__doc__)
    p.add_argument("action", choices=("down", "up"))
    p.add_argument("name", help="host name, e.g. host-1")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = p.parse_args(argv)
    state = _state(args.state_dir.resolve())
    if state is None:
        print(f"quartctl host: nothing is running (no {args.state_dir.resolve() / STATE_FILE})", file=sys.stderr)
        return 1
    if not state.get("network"):
        print("quartctl host: this cluster runs on loopback; host links exist only with "
              "`quartctl up --network netns`", file=sys.stderr)
        return 2
    network = HostNetwork.from_json(state["network"])
    try:
        (network.link_down if args.action == "down" else network.link_up)(args.name)
    except NetworkError as exc:
        print(f"quartctl host: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: link {args.action}")
    return 0


def _password(args: argparse.Namespace, state_dir: Path) -> tuple[str, str]:
    if args.password_stdin:
        return args.username, sys.stdin.read().strip()
    if os.environ.get("OPENFAAS_PASSWORD"):
        return args.username, os.environ["OPENFAAS_PASSWORD"]
    from quart_transport.auth import PASSWORD_FILE, USER_FILE

    secrets = state_dir / "secrets"
    try:
        return (secrets / USER_FILE).read_text().strip(), (secrets / PASSWORD_FILE).read_text().strip()
    except FileNotFoundError:
        raise SystemExit(f"quartctl deploy: no credentials: pass --password-stdin, set OPENFAAS_PASSWORD, or run "
                         f"`quartctl up` (writes {secrets})") from None


def deploy(argv: list[str]) -> int:
    """Send the same REST calls `faas-cli deploy` sends: PUT /system/functions, POST when it answers 404."""
    import requests

    p = cliargs.ArgumentParser(prog="quartctl deploy", description=deploy.__doc__)
    p.add_argument("-f", "--file", "--yaml", dest="file", required=True, help="stack.yml")
    p.add_argument("-g", "--gateway", default=None, help="gateway URL (default: stack provider.gateway, "
                   "OPENFAAS_URL, or the running `quartctl up`)")
    p.add_argument("-u", "--username", default="admin")
    p.add_argument("--password-stdin", action="store_true")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--filter", default=None, help="deploy only this function")
    args = p.parse_args(argv)
    state_dir = args.state_dir.resolve()
    try:
        stack = load_stack(args.file)
    except StackError as exc:
        print(f"quartctl deploy: {exc}", file=sys.stderr)
        return 2
    state = _state(state_dir) or {}
    gateway = (args.gateway or os.environ.get("OPENFAAS_URL") or state.get("url") or stack.gateway
               or "http://127.0.0.1:8080").rstrip("/")
    user, password = _password(args, state_dir)
    from quart_provider.images import INDEX_FILE, ImageIndex

    ImageIndex(state_dir / INDEX_FILE).register(stack.image_index_entries())
    failures = 0
    with requests.Session() as session:
        session.auth = (user, password)
        for function in stack.functions:
            if args.filter and function.name != args.filter:
                continue
            print(f"Deploying: {function.name}.")
            try:
                res = session.put(f"{gateway}/system/functions", json=function.request, timeout=60)
                if res.status_code == 404:
                    res = session.post(f"{gateway}/system/functions", json=function.request, timeout=60)
                elif res.status_code == 200:
                    print(f"Function {function.name} already exists, attempting rolling-update.")
            except requests.RequestException as exc:
                print(f"Is the gateway running at {gateway}? {exc}", file=sys.stderr)
                return 1
            if res.status_code in (200, 201, 202):
                print(f"Deployed. {res.status_code}.\nURL: {gateway}/function/{function.name}\n")
            elif res.status_code == 401:
                print("unauthorized access, run \"faas-cli login\" to setup authentication for this server",
                      file=sys.stderr)
                failures += 1
            else:
                print(f"Unexpected status: {res.status_code}, message: {res.text}", file=sys.stderr)
                failures += 1
    return 1 if failures else 0

"""Issue 14 item 4: replicas as an unprivileged user of their own (``quart_stage.privdrop``), their secrets
readable by that user alone; the platform's socket and state out of reach once dropped."""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
from quart_provider.secrets import mount
from quart_stage.privdrop import drop_privileges, parse_run_as
from support.faas_cli import Running, faas_cli_deploy_body

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def test_run_as_is_never_root_and_well_formed():
    assert parse_run_as("300000:300000") == (300000, 300000) and parse_run_as("7") == (7, 7)
    for bad in ("0", "0:5", "5:0", "x", "-1"):
        with pytest.raises(ValueError):
            parse_run_as(bad)


@needs_root
def test_a_dropped_process_cannot_read_the_platforms_files_nor_its_socket_nor_regain_root(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "token").write_text("secret")
    os.chmod(private / "token", 0o600)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(private / "km.sock"))
    server.listen(1)
    read_r, write_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls, then _exit
        outcome = []
        try:
            drop_privileges(NOBODY, NOBODY)
            outcome.append(f"{os.getuid()}:{os.getgid()}:{os.getgroups()}")
            for attempt in (lambda: open(private / "token").read(),
                            lambda: socket.socket(socket.AF_UNIX).connect(str(private / "km.sock")),
                            lambda: os.setuid(0)):
                try:
                    attempt()
                    outcome.append("allowed")
                except PermissionError:
                    outcome.append("denied")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(repr(exc))
        os.write(write_w, ",".join(outcome).encode())
        os._exit(0)
    os.close(write_w)
    try:
        got = os.read(read_r, 4096).decode()
    finally:
        os.close(read_r)
        os.waitpid(pid, 0)
        server.close()
    assert got == f"{NOBODY}:{NOBODY}:[],denied,denied,denied"


@needs_root
def test_secret_mounts_belong_to_the_functions_user_alone(tmp_path):
    source = tmp_path / "function-secrets" / "openfaas-fn"
    source.mkdir(parents=True)
    (source / "api-key").write_text("v")
    folder = mount(source, ["api-key"], "host-0-f-1", (300001, 300001))
    st = folder.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (300001, 0o700)
    assert (folder / "api-key").stat().st_uid == 300001
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o711  # others pass through, never list


def test_each_function_gets_its_own_uid_kept_across_restarts(tmp_path):
    def uids(running) -> dict[str, int | None]:
        async def read() -> dict[str, int | None]:
            return {n: f.run_as for n, f in running.system.gateway.functions.items()}
        return running.call(read())

    idle = {"com.openfaas.scale.min": "0", "com.openfaas.scale.max": "2"}  # nothing starts: only the uids count
    first = Running(tmp_path, replica_uids="300000-300001")
    try:
        assert first.deploy(faas_cli_deploy_body("a", labels=idle)).status_code == 202
        assert first.deploy(faas_cli_deploy_body("b", labels=idle)).status_code == 202
        full = first.deploy(faas_cli_deploy_body("c", labels=idle))
        assert full.status_code == 507 and full.json()["field"] == "service"
        before = uids(first)
        assert sorted(before.values()) == [300000, 300001]
        fn = first.system.gateway.functions["a"]
        env = fn.replica_spec(1024).env
        assert env["QUART_RUN_AS"] == f"{before['a']}:{before['a']}" and env["HOME"].startswith("/tmp/")
    finally:
        first.close()
    second = Running(tmp_path, replica_uids="300000-300001")
    try:
        assert uids(second) == before
        assert requests.get(f"{second.url}/system/function/a", auth=second.auth, timeout=5).status_code == 200
    finally:
        second.close()


def _interpreter_usable_by(uid: int) -> bool:
    try:
        return subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: drop_privileges(uid, uid),
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@needs_root
def test_process_replicas_serve_as_their_functions_user(tmp_path, monkeypatch, request):
    if not _interpreter_usable_by(NOBODY):
        # the echo replica needs only the standard library: a system interpreter will do
        system_python = "/usr/bin/python3"
        if sys.executable == system_python or not os.path.exists(system_python):
            pytest.skip(f"{sys.executable} is not usable by an unprivileged user here (e.g. under /root, 0700)")
        monkeypatch.setattr(sys, "executable", system_python)
        if not _interpreter_usable_by(NOBODY):
            pytest.skip("no interpreter here is usable by an unprivileged user")
        # ... with the project's packages on its path (an editable install is seen by the venv's interpreter only)
        packages = Path(tempfile.mkdtemp(prefix="quart-packages-", dir="/tmp"))  # pytest's tmp_path is 0700
        request.addfinalizer(lambda: shutil.rmtree(packages, ignore_errors=True))
        packages.chmod(0o755)
        for name in ("quart_provider", "quart_transport", "quart_stage", "keysmanager"):  # what quart/echo imports
            (packages / name).symlink_to(Path(importlib.import_module(name).__file__).parent)
        monkeypatch.setenv("PYTHONPATH", str(packages))
        probe = subprocess.run([system_python, "-c", "import quart_provider.echo"], capture_output=True, timeout=60,
                               preexec_fn=lambda: drop_privileges(NOBODY, NOBODY), env={"PYTHONPATH": str(packages)})
        if probe.returncode != 0:
            pytest.skip(f"the project's files are not readable by an unprivileged user here: {probe.stderr[-200:]!r}")
    running = Running(tmp_path, replica_uids=f"{NOBODY}-{NOBODY}")
    try:
        assert running.deploy(faas_cli_deploy_body("echo")).status_code == 202
        running.wait_available("echo", 1)
        [replica] = running.replicas("echo")["replicas"]
        host = running.system.gateway.hosts[replica["host"]]
        pid = host._children[replica["id"]].process.pid  # noqa: SLF001 - the test looks at the OS process
        assert os.stat(f"/proc/{pid}").st_uid == NOBODY
        assert requests.post(f"{running.url}/function/echo", data=b"hi", timeout=10).content == b"hi"
    finally:
        running.close()


@needs_root
def test_keysmanager_replicas_serve_as_their_functions_user(tmp_path):
    """Forked from a zygote (root, it mapped the parameters) and dropped before serving: no exec, so the
    interpreter's location does not matter."""
    import asyncio
    import json
    import time

    import aiohttp
    from quart_provider.config import GatewayConfig
    from quart_provider.deployment import FunctionDeployment
    from quart_provider.stack import load_stack
    from quart_provider.system import EmbeddedSystem
    from quart_tools.partition import partition

    partition("bert-21b", 2, str(tmp_path / "m"), weights="none", progress=False,
              stack={"compute": "emulated", "scale_min": 1, "scale_max": 2})

    async def run() -> tuple[dict[str, int], dict[str, int], int]:
        cfg = GatewayConfig(port=0, state_dir=tmp_path / "state", hosts=1, gpus_per_host=2, reconcile_interval_s=0.1,
                            drain_timeout_s=2, replica_uids="300000-300009")
        system = EmbeddedSystem(cfg, use_keysmanager=True)
        await system.start()
        try:
            gw = system.gateway
            stack = load_stack(tmp_path / "m" / "stack.yml")
            gw.images.register(stack.image_index_entries())
            for fn in stack.functions:
                await gw.registry.deploy(FunctionDeployment.from_json(fn.request, cfg.namespace))
            deadline = time.monotonic() + 120
            while not all(f.ready for f in gw.functions.values()):
                assert time.monotonic() < deadline, {n: f.last_error for n, f in gw.functions.items()}
                await asyncio.sleep(0.05)
            km_pid = system.agents[0].process.pid
            owners, wanted = {}, {}
            for f in gw.functions.values():
                wanted[f.name] = f.run_as
                for line in os.popen("ps -eo pid,uid,ppid --no-headers").read().splitlines():
                    pid, uid, _ = map(int, line.split())
                    if pid != km_pid and uid == f.run_as:
                        owners[f.name] = uid
            async with aiohttp.ClientSession() as session, session.post(
                    f"{system.url}/function/{stack.functions[0].name}", data=json.dumps({"input_ids": [[1, 2, 3]]}),
                    headers={"Content-Type": "application/json"}) as res:
                status = res.status
            return owners, wanted, status
        finally:
            await system.stop()

    owners, wanted, status = asyncio.run(run())
    assert owners == wanted and len(set(wanted.values())) == 2 and status == 200

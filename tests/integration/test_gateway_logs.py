"""GET /system/logs as faas-cli's proxy/logs.go reads it: NDJSON faas-provider ``logs.Message`` lines from the
replicas' log files; tail, instance, since, follow (streaming until the client goes away)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta

import aiohttp
import requests
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.stack import load_stack
from quart_provider.system import EmbeddedSystem
from support.faas_cli import faas_cli_deploy_body

MESSAGE_KEYS = {"name", "namespace", "instance", "timestamp", "text"}


def get_logs(gw, **params) -> list[dict]:
    res = requests.get(f"{gw.url}/system/logs", params={"follow": "false", **params}, auth=gw.auth, timeout=10)
    assert res.status_code == 200 and res.headers["Content-Type"].startswith("application/x-ndjson"), res.text
    return [json.loads(line) for line in res.text.splitlines()]


def wait_lines(gw, count: int, **params) -> list[dict]:
    deadline = time.monotonic() + 10
    while len(lines := get_logs(gw, **params)) < count:
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    return lines


def test_logs_in_the_shape_faas_cli_reads(gw):
    labels = {"com.openfaas.scale.min": "2", "com.openfaas.scale.max": "4"}
    assert gw.deploy(faas_cli_deploy_body("talker", labels=labels)).status_code == 202
    gw.wait_available("talker", 2)
    lines = wait_lines(gw, 2, name="talker")
    replicas = {r["id"] for r in gw.replicas("talker")["replicas"]}
    assert {m["instance"] for m in lines} == replicas
    for m in lines:
        assert set(m) == MESSAGE_KEYS and (m["name"], m["namespace"]) == ("talker", "openfaas-fn")
        assert m["text"].startswith("quart/echo listening on 127.0.0.1:")
        datetime.fromisoformat(m["timestamp"].replace("Z", "+00:00"))
    assert len(get_logs(gw, name="talker", tail="1")) == 1
    one = sorted(replicas)[0]
    assert [m["instance"] for m in get_logs(gw, name="talker", instance=one)] == [one]
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    assert get_logs(gw, name="talker", since=future) == []
    assert len(get_logs(gw, name="talker", namespace="openfaas-fn", since="2000-01-01T00:00:00Z")) == 2

    url = f"{gw.url}/system/logs"
    for params, code, field in (({"name": "talker", "namespace": "other"}, 404, "namespace"),
                                ({"name": "nope"}, 404, "functionName"), ({"name": "talker", "tail": "x"}, 422, "tail"),
                                ({"name": "talker", "since": "yesterday"}, 422, "since"), ({}, 400, "name")):
        res = requests.get(url, params=params, auth=gw.auth, timeout=5)
        assert (res.status_code, res.json()["field"]) == (code, field), (params, res.text)
    assert requests.get(url, params={"name": "talker"}, timeout=5).status_code == 401


def test_follow_streams_new_lines_and_new_replicas_until_the_client_leaves(gw):
    assert gw.deploy(faas_cli_deploy_body("talker")).status_code == 202
    gw.wait_available("talker", 1)
    wait_lines(gw, 1, name="talker")
    res = requests.get(f"{gw.url}/system/logs", params={"name": "talker", "follow": "true"}, auth=gw.auth,
                       stream=True, timeout=15)
    assert res.status_code == 200
    lines = (json.loads(line) for line in res.iter_lines() if line)
    assert next(lines)["text"].startswith("quart/echo listening")
    [path] = list((gw.system.config.replica_logs_dir / "talker").glob("*.log"))
    with open(path, "a") as fh:  # what the replica would print
        fh.write("first line\nsecond ")
        fh.flush()
        time.sleep(0.3)
        fh.write("half\n")
    assert [next(lines)["text"] for _ in range(2)] == ["first line", "second half"]
    assert gw.scale("talker", 2).status_code == 202  # a replica started while following shows up
    new = next(lines)
    assert new["text"].startswith("quart/echo listening") and new["instance"] != path.stem
    started = time.monotonic()
    res.close()  # the client leaves: the stream ends on the gateway's side
    assert time.monotonic() - started < 2
    assert requests.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=5).status_code == 200


def test_keysmanager_stage_replicas_logs_are_found(tmp_path, emulated_stack):  # noqa: F811
    """Stage replicas fork from the KeysManager's zygote and write to its log; /system/logs lists it."""
    async def main() -> list[tuple[str, object]]:
        cfg = GatewayConfig(port=0, state_dir=tmp_path / "state", hosts=1, gpus_per_host=2, drain_timeout_s=5)
        system = EmbeddedSystem(cfg, use_keysmanager=True)
        await system.start()
        try:
            gw = system.gateway
            stack = load_stack(emulated_stack)
            gw.images.register(stack.image_index_entries())
            fn = stack.functions[0]
            await gw.registry.deploy(FunctionDeployment.from_json(fn.request, cfg.namespace))
            deadline = time.monotonic() + 120
            while not gw.functions[fn.name].ready:
                assert time.monotonic() < deadline, gw.functions[fn.name].last_error
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as session:  # a body that is no activation: a 400, logged too
                async with session.post(f"{system.url}/function/{fn.name}", data=b"not a tensor",
                                        headers={"X-Call-Id": "km-call-1"}) as res:
                    assert res.status == 400, await res.text()
            await asyncio.sleep(0.2)
            return await gw.log_files(fn.name)
        finally:
            await system.stop()

    files = asyncio.run(main())
    assert files and all(path.is_file() for _, path in files), files
    assert any(instance.startswith("host-0-zygote-") for instance, _ in files), files
    text = "".join(path.read_text() for _, path in files)
    assert any("access call_id=km-call-1 method=POST" in line and "status=400" in line
               for line in text.splitlines()), text[-2000:]

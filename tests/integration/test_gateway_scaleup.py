"""Scale request → replica ready → first traffic, through the embedded gateway and a real KeysManager.

A parameter-free emulated stage forks from its KeysManager zygote in tens of milliseconds; the gateway
must not add seconds on top (it used to learn readiness only at its next host poll). The reconcile
period is set far above the bound, so only the gateway's own readiness probe can meet it.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.stack import load_stack
from quart_provider.system import EmbeddedSystem
from quart_stage.errors import QuartError
from quart_stage.labels import KEYSMANAGER as LABEL_KEYSMANAGER

from keysmanager.aio import within

READY_BOUND_S = 2.0  # generous: measured 30–80 ms on the shared 2-core machine, even with 3 CPU burners


async def _scale_up_timings(stack_path, state_dir) -> dict:
    cfg = GatewayConfig(port=0, state_dir=state_dir, hosts=1, gpus_per_host=6, reconcile_interval_s=30.0,
                        drain_timeout_s=5)
    system = EmbeddedSystem(cfg, use_keysmanager=True)
    await system.start()
    try:
        gw = system.gateway
        stack = load_stack(stack_path)
        await system.deploy_stack(stack)
        name = stack.functions[0].name
        fn = gw.functions[name]
        deadline = time.monotonic() + 120  # the first replica also builds the zygote
        while len(fn.ready) < 1:
            assert time.monotonic() < deadline, f"first replica of {name} not ready: {fn.last_error}"
            await asyncio.sleep(0.01)
        first = fn.ready[0]

        asked = time.monotonic()
        assert await gw.registry.scale(name, 2) == 2
        while len(fn.ready) < 2:
            assert time.monotonic() - asked < 30, "the second replica never became ready"
            await asyncio.sleep(0.002)
        ready_s = time.monotonic() - asked
        new = next(e for e in fn.ready if e is not first)
        assert new.source == "fork"

        body = json.dumps({"input_ids": [[1, 2, 3, 4]]}).encode()
        first.in_flight += 1  # the old replica is busy: least-loaded routing must pick the new one
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, session.post(
                    f"{system.url}/function/{name}", data=body, headers={"Content-Type": "application/json"}) as res:
                assert res.status == 200, await res.text()
                await res.read()
        finally:
            first.in_flight -= 1
        served_s = time.monotonic() - asked

        # the same function redeployed without the parameter cache: running replicas stay, new ones cold-start
        request = dict(stack.functions[0].request)
        request["labels"] = {**request.get("labels", {}), LABEL_KEYSMANAGER: "off"}
        await gw.registry.update(FunctionDeployment.from_json(request, cfg.namespace))
        assert await gw.registry.scale(name, 3) == 3
        deadline = time.monotonic() + 120
        while len(fn.ready) < 3:
            assert time.monotonic() < deadline, f"the cold replica never became ready: {fn.last_error}"
            await asyncio.sleep(0.01)
        sources = sorted(e.source for e in fn.ready)
        return {"ready_s": ready_s, "served_s": served_s, "new_served": new.served, "sources": sources,
                "kept": first in fn.ready and new in fn.ready}
    finally:
        try:
            await within(60, system.stop())
        except TimeoutError:  # a bounded failure that names the step, not the suite's 300 s timeout
            pytest.fail("the embedded system did not stop within 60 s")


def test_scale_up_to_ready_and_first_traffic_is_fast(emulated_stack, tmp_path):
    timings = asyncio.run(_scale_up_timings(emulated_stack, tmp_path / "state"))
    assert timings["ready_s"] < READY_BOUND_S, timings
    assert timings["new_served"] == 1 and timings["served_s"] < READY_BOUND_S + 1.0, timings
    # the first replica paid for loading the zygote (cold), the second forked, the third ran without the cache
    assert timings["kept"] and timings["sources"] == ["cold", "cold", "fork"], timings


def test_keysmanager_label_takes_on_or_off_only():
    ok = FunctionDeployment.from_json({"service": "s", "image": "i", "labels": {LABEL_KEYSMANAGER: "off"}}, "openfaas-fn")
    assert not ok.param_cache and FunctionDeployment.from_json({"service": "s", "image": "i"}, "openfaas-fn").param_cache
    with pytest.raises(QuartError) as err:
        FunctionDeployment.from_json({"service": "s", "image": "i", "labels": {LABEL_KEYSMANAGER: "maybe"}},
                                     "openfaas-fn")
    assert err.value.status == 400 and LABEL_KEYSMANAGER in str(err.value)

"""Batching in the simulator (quart_tools.sim.batching): the same batches as the router, the profile the policies fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.batch_capacity import fit
from quart_tools.arrivals import poisson_arrivals
from quart_tools.sim.batching import batched_fifo_waits, profile_s, relative_time
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from quart_tools.sim.oracle import _fifo_waits

GB = 1_000_000_000
CAL = Calibration(service_cv=0.0, hosts=1, gpus_per_host=2)


def _cfg(**kw) -> SimConfig:
    return SimConfig(model="m", stages=(StageSpec("m-stage-0", 0.01, 2 * GB),), slo_s=1.0, calibration=CAL, hop_s=0.0,
                     queue_cap=10**9, initial_replicas=1, placer="first-fit", keysmanager=False, **kw)


def test_batched_fifo_waits_by_hand_and_without_batching() -> None:
    # one replica: the first arrival alone (0 → 1), the three that waited in one call of S(3) = 1·(0.5 + 0.5·3) = 2
    # (1 → 3), the last one waits for it
    waits = batched_fifo_waits([0.0, 0.1, 0.2, 0.3, 2.5], [1.0] * 5, 0.0, 1, 16, 0.5)
    assert waits == pytest.approx([0.0, 0.9, 0.8, 0.7, 0.5])
    # batch_max 1 is the plain FIFO queue
    rng = np.random.default_rng(1)
    arr = np.sort(rng.uniform(0, 10, 300)).tolist()
    work = rng.uniform(0.01, 0.05, 300).tolist()
    assert batched_fifo_waits(arr, work, 0.002, 2, 1, 0.3) == pytest.approx(
        _fifo_waits(arr, [w + 0.002 for w in work], 2))


def test_a_replica_serves_what_waits_as_one_call_and_the_router_table_fills() -> None:
    rate = 150.0  # 1.5 × what the one replica serves one at a time (S(1) = 10 ms)
    arrivals = poisson_arrivals(rate, 60.0, seed=2)
    static = make_policy("static", replicas=1)
    alone = Simulation(_cfg(drain_s=600.0), static, arrivals).run()
    sim = Simulation(_cfg(batch_max=16, batch_fixed=0.6), make_policy("static", replicas=1), arrivals)
    batched = sim.run()
    assert not np.isnan(batched.latencies_ms).any()  # every request answered once
    # one at a time the queue grows without bound; batched (capacity 16/(0.6+0.4·16) = 2.3×) it stays short
    assert np.nanmean(batched.latencies_ms) < 100 < np.nanmean(alone.latencies_ms)
    table = sim.stages[0].metrics.batch_service_s()
    sizes = {size: n for size, n, _ in table}
    assert max(sizes) > 1 and max(sizes) <= 16
    assert sum(size * n for size, n, _ in table) == len(arrivals)
    for size, _, mean_s in table:  # the profile S(b) = S(1)·(f + (1 − f)·b), CV 0
        assert mean_s == pytest.approx(0.01 * relative_time(size, 0.6))
    p = fit(table, 16)
    assert p.fixed_s == pytest.approx(0.006) and p.per_request_s == pytest.approx(0.004)
    state = sim.control.stage_state("m-stage-0")  # what the policies see: the limit and the profile as a label gives it
    assert state.batch_max == 16 and state.batch_profile_s == profile_s(0.01, 16, 0.6)
    assert state.batch_profile_s[-1] == (16, pytest.approx(0.01 * 7.0))


def test_cli_batching_flags(tmp_path) -> None:
    from quart_tools.sim.cli import main

    out = tmp_path / "one.json"
    assert main(["--model", "wideresnet", "--system", "quart", "--duration", "20", "--load", "0.2", "--batching",
                 "--batch-max", "8", "--batch-fixed", "0.8", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["completed"] > 0
    assert main(["--model", "wideresnet", "--batching", "--batch-fixed", "1.0"]) == 2
    assert main(["--model", "wideresnet", "--batching", "--batch-max", "0"]) == 2

"""One ParaServe parts rule (issue 26): the gateway (`ParaServeStarts`) and the simulator (`ReplicaStarts`) choose
P by the kernel's `choose_parts`, so the same cold stage on the same hosts gets the same P from both; layers are
split and groups protected by `quart_kernel.scheduling.paraserve_groups` alone."""

from __future__ import annotations

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from quart_kernel.scheduling.paraserve import FetchHost, ParaServeCosts, choose_parts
from quart_kernel.scheduling.paraserve_groups import StageLayout, consolidating, group_plans
from quart_kernel.scheduling.starts import StartPlan
from quart_kernel.scheduling.types import HostView
from quart_provider.config import GatewayConfig
from quart_provider.paraserve_start import ParaServeStarts
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import GB, Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

STAGE_BYTES = 12 * GB // 4  # 3 GB in 12 equal layers: every P ≤ 4 splits it evenly (the sim knows no layers)
LAYERS = (STAGE_BYTES // 12,) * 12
NIC_GBYTES_S = 1.0  # each host's fetch rate
FIXED_S = 0.5  # a part worker's start, overlapped with its fetch
HOSTS = 4


def _live_parts(slo_s: float, fixed: int = 0, free: int = HOSTS) -> int:
    config = GatewayConfig(nic_gbps=NIC_GBYTES_S * 8, registry_gbps=0.0, paraserve=True, paraserve_max_parts=4,
                           paraserve_slo_ms=slo_s * 1000, paraserve_fixed_s=FIXED_S, paraserve_parts=fixed)
    views = [HostView(f"h{i}", 1, 0 if i < free else 1, 10 * GB, 0) for i in range(HOSTS)]
    return ParaServeStarts(config).parts_for(views, {"m-stage-0": StageLayout(0, 12, LAYERS)})["m-stage-0"]


def _sim_parts(slo_s: float) -> int:
    cal = Calibration(hosts=HOSTS, gpus_per_host=1, disk_gbps=NIC_GBYTES_S, registry_gbytes_s=1e9, h2d_gbps=1e12,
                      cold_fixed_s=FIXED_S, paraserve_overlap=True)
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", 1e-9, STAGE_BYTES),), slo_s=1.0, calibration=cal,
                    initial_replicas=0, paraserve_slo_s=slo_s, paraserve_max_parts=4, keysmanager=False)
    sim = Simulation(cfg, make_policy("quart"), Arrivals(np.zeros(0), np.zeros(0, dtype=np.int64)))
    return sim.starts.paraserve_parts("m-stage-0", [h.view() for h in sim.hosts])


@pytest.mark.parametrize(("slo_s", "parts"), [(4.0, 1), (2.0, 2), (1.2, 3), (0.8, 4), (0.5, 4)])
def test_the_gateway_and_the_simulator_choose_the_same_parts(slo_s: float, parts: int) -> None:
    # overlapped start: P parts answer after max(0.5 s, 3 GB / P at 1 GB/s) + 1 ms a hop: 3, 1.501, 1.002, 0.753 s;
    # no P meets 0.5 s: the earliest (P = 4)
    assert _live_parts(slo_s) == _sim_parts(slo_s) == parts


def test_p_is_capped_by_the_free_hosts_and_the_layers_and_may_be_forced() -> None:
    assert _live_parts(0.5, free=2) == 2  # only two hosts can take a part
    assert _live_parts(4.0, fixed=3) == 3  # forced (benchmarks)
    assert _live_parts(4.0, fixed=9) == 4  # forced, within max_parts
    costs = ParaServeCosts(registry_bytes_s=float("inf"))
    hosts = [FetchHost(f"h{i}", GB) for i in range(8)]
    assert choose_parts(3 * GB, 0.0, hosts, costs, max_parts=8, layer_bytes=(GB,) * 3).parts == 3  # 3 layers
    assert choose_parts(STAGE_BYTES, 0.0, [], costs, fixed_parts=2).parts == 1  # no host free yet


def test_a_group_holds_balanced_parts_and_stays_protected_until_whole() -> None:
    layout = StageLayout(4, 8, (10, 30, 10, 10))
    plans = [StartPlan("f", "h0", "paraserve", group=("h0", "h1"), helpers=("h1",)),
             StartPlan("g", "h2", "fork")]
    by_plan, new = group_plans(plans, {"f": layout})
    assert list(by_plan) == [0] and new == [by_plan[0]]
    assert by_plan[0].parts == [(4, 6), (6, 8)] and by_plan[0].part_on("h1") == (6, 8)
    assert consolidating(1, [])  # a start not answered yet
    assert consolidating(0, [True, False]) and not consolidating(0, [True, True]) and not consolidating(0, [])

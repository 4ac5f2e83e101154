"""A ParaServe group that becomes whole keeps as many workers as the sliding-window rule says (issue 29): the
gateway's reconciler raises the function's desired count to `workers_to_keep` of the session engine's demand,
through the registry's `set_desired`, and the one convergence lets the other workers go."""

from __future__ import annotations

from types import SimpleNamespace

from quart_kernel.convergence import FunctionView, PlatformView, ReplicaView, leaving
from quart_kernel.scheduling import make_placer
from quart_kernel.scheduling.paraserve_gen import GroupDemand, desired_after_consolidation, workers_to_keep
from quart_kernel.scheduling.paraserve_groups import Group
from quart_provider.config import GatewayConfig
from quart_provider.reconciler import Reconciler
from quart_provider.scheduler_metrics import SchedulerMetrics
from quart_provider.types import Endpoint

HOSTS = ("h0", "h1", "h2", "h3")
NOW = 100.0


def _cluster(held: tuple[int, int] = (0, 8)):
    """A function ``f`` whose group of four workers (parts of layers [0, 8)) has every start answered; each
    member holds ``held`` (the first one always the whole stage)."""
    members = {f"r{i}": Endpoint(f"r{i}", "f", h, f"http://{h}", "ready", "cold", 1, 0.0, layers=(0, 8),
                                 held=(0, 8) if i == 0 else held) for i, h in enumerate(HOSTS)}
    fn = SimpleNamespace(name="f", desired=1, replicas=members)
    set_to: list[tuple[str, int]] = []

    def set_desired(name: str, replicas: int) -> int:
        set_to.append((name, replicas))
        fn.desired = replicas
        return replicas

    rec = Reconciler(GatewayConfig(paraserve=True, paraserve_window_s=2.0), {}, make_placer("first-fit"), {"f": fn},
                     {}, SchedulerMetrics(), set_desired)
    group = Group("f", HOSTS, [(0, 2), (2, 4), (4, 6), (6, 8)])
    for rid in members:
        group.started([rid])
    rec.paraserve.groups["f"] = [group]
    return rec, fn, set_to


def _leaving(fn) -> list[str]:
    """The replicas the one convergence lets go of ``fn`` at its desired count now."""
    view = FunctionView("f", fn.desired, 1, tuple(ReplicaView(e.id, e.state, 1) for e in fn.replicas.values()))
    return [a.replica for a in leaving(PlatformView(NOW, (view,)))]


def test_a_whole_group_under_a_burst_keeps_the_workers_the_sliding_window_needs() -> None:
    rec, fn, set_to = _cluster()
    burst = GroupDemand(arrivals=tuple(NOW - 0.1 * i for i in range(9)) + (NOW - 5.0,), waiting=3, per_worker=4)
    rec.demand = lambda name: burst
    assert rec.paraserve.protected(fn) == set()  # every member whole: the group is done
    rec.keep_groups(NOW)
    keep = workers_to_keep(burst.arrivals, NOW, 2.0, 3, 4, 4)
    assert keep == 3  # 9 arrivals in the last 2 s + 3 waiting = 12 sessions at 4 a worker (the one at -5 s is old)
    assert set_to == [("f", keep)] and fn.desired == 3 and rec.paraserve.kept == [("f", 3)]
    assert len(_leaving(fn)) == 1  # four whole workers, three kept: one leaves
    rec.keep_groups(NOW + 1)  # once per group
    assert set_to == [("f", 3)]


def test_a_quiet_whole_group_scales_down_to_one_and_a_higher_desired_count_stays() -> None:
    rec, fn, set_to = _cluster()
    rec.paraserve.protected(fn)
    rec.keep_groups(NOW)  # no engine attached: no demand, one worker
    assert set_to == [] and fn.desired == 1 and len(_leaving(fn)) == 3
    assert desired_after_consolidation(5, GroupDemand((NOW,), 0, 1), NOW, 2.0, 4) == 5  # never lowered


def test_a_group_still_consolidating_changes_nothing() -> None:
    rec, fn, set_to = _cluster(held=(2, 8))  # three members still fetching the rest of the stage
    rec.demand = lambda name: GroupDemand(tuple(NOW for _ in range(20)), 0, 1)
    assert rec.paraserve.protected(fn) == {"r0", "r1", "r2", "r3"}
    rec.keep_groups(NOW)
    assert set_to == [] and fn.desired == 1

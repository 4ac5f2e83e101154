"""Equal-cost experiment (issue 15): the oracle meets its budget and beats static at equal cost, the static
frontier is monotone, the CLI writes the documented JSON (short simulated runs)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from quart_tools.arrivals import gamma_arrivals
from quart_tools.sim import cli
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import Simulation
from quart_tools.sim.experiments import rate_for
from quart_tools.sim.frontier import frontier_at, frontier_points
from quart_tools.sim.oracle import (
    ORACLE_TOLERANCE,
    Schedule,
    ScheduledPolicy,
    pick_run,
    run_oracle,
    served_replica_seconds,
)
from quart_tools.sim.scenario import sim_config, system

MODEL = "bert-21b"


@pytest.fixture(scope="module")
def bursty():
    """BERT-21B at load 0.4, gamma CV 8 (bursts), 60 simulated seconds; static-3 … static-5 on it."""
    cal = Calibration()
    arrivals = gamma_arrivals(rate_for(MODEL, 0.4, cal), 8.0, 60.0, seed=3)
    cfg = sim_config(MODEL, system("quart"), cal, seed=3)
    statics = {}
    for k in (3, 4, 5):
        result = Simulation(cfg, make_policy("static", replicas=k), arrivals).run()
        statics[k] = (served_replica_seconds(result), float(np.nanmean(result.latencies_ms)))
    return cfg, arrivals, statics


def test_static_frontier_is_monotone(bursty) -> None:
    _, _, statics = bursty
    costs = [statics[k][0] for k in sorted(statics)]
    means = [statics[k][1] for k in sorted(statics)]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    assert all(b <= a for a, b in zip(means, means[1:], strict=False)), means


def test_the_oracle_takes_a_cheaper_faster_run_and_never_one_over_its_tolerance() -> None:
    # (realised / budget − 1, mean): a run the plan could not spend the budget on (nobody waits at more replicas)
    # is a schedule within the budget too; one 5 % over is not, however fast (issue 32: BERT trace-quiet, the 5 s
    # window at 0.81 × the budget beat the 60 s window at it, and was left out)
    runs = [(-0.19, 1625.8), (0.002, 1701.3), (0.05, 1500.0), (0.01, 1690.0)]
    assert pick_run(runs, ORACLE_TOLERANCE) == (-0.19, 1625.8)
    assert pick_run([(0.05, 1500.0), (0.08, 1400.0)], ORACLE_TOLERANCE) == (0.05, 1500.0)  # none within: closest
    assert pick_run([(-0.01, float("nan")), (0.02, 900.0)], ORACLE_TOLERANCE) == (0.02, 900.0)


def test_oracle_meets_its_budget_and_beats_static_at_equal_cost(bursty) -> None:
    cfg, arrivals, statics = bursty
    budget, static_mean = statics[4]
    result = run_oracle(cfg, arrivals, budget, max_replicas=12)
    cost = result.entry["replica_seconds"]
    assert cost / budget - 1.0 <= ORACLE_TOLERANCE, result.runs
    assert result.entry["mean_ms"] <= static_mean, (result.entry["mean_ms"], static_mean, result.runs)
    assert result.schedule.counts.min() >= cfg.min_replicas


def test_scheduled_policy_asks_a_start_time_ahead() -> None:
    sched = Schedule(5.0, np.array([[1, 4, 2]]))
    policy = ScheduledPolicy(sched, lead_s=1.0)
    from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot

    def at(t: float) -> int:
        snap = PipelineSnapshot(t, "m", (StageSnapshot("m-stage-0", 0, 1.0, 10.0, 1),))
        return policy.decide(snap).stages[0].replicas

    assert [at(t) for t in (0.0, 3.0, 4.0, 5.0, 9.0, 10.0, 20.0)] == [1, 1, 4, 4, 4, 2, 2]
    assert sched.planned_replica_seconds == 35.0


def test_frontier_interpolation() -> None:
    pts = frontier_points([{"policy": f"static-{k}", "replica_seconds": c, "mean_ms": m}
                           for k, c, m in ((1, 100.0, 900.0), (2, 200.0, 300.0), (3, 300.0, 310.0), (4, 400.0, 100.0))])
    assert frontier_at(pts, 150.0) == (600.0, "interpolated")
    assert frontier_at(pts, 300.0)[0] == pytest.approx(200.0)  # static-3 is off the envelope (dearer, slower)
    assert frontier_at(pts, 50.0) == (None, "below the cheapest static")
    assert frontier_at(pts, 500.0) == (100.0, "clamped")


def _trace(path) -> str:
    """A small Azure-format trace: bursts of requests every few seconds for 117 s (longer than a --quick window)."""
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(1600):
        t = t0 + timedelta(seconds=(i // 40) * 3 + (i % 40) * 0.01)
        rows.append(f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,100,10")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_cli_writes_the_documented_json(tmp_path) -> None:
    out, plots = tmp_path / "frontier.json", tmp_path / "plots"
    rc = cli.main(["--experiment", "frontier", "--quick", "--models", "wideresnet", "--cvs", "4",
                   "--trace", _trace(tmp_path / "trace.csv"), "--max-replicas", "3", "--workers", "2",
                   "--out", str(out), "--plots", str(plots)])
    assert rc == 0
    doc = json.loads(out.read_text())
    entries = doc["entries"]
    windows = {f"wideresnet/trace-{k}" for k in ("busy", "quiet", "step")}
    assert {e["workload"] for e in entries} == {"wideresnet/cv4", *windows}
    for e in entries:
        assert {"workload", "policy", "mean_ms", "p99_ms", "slo_attainment", "replica_seconds"} <= set(e)
        assert {"1.0", "1.5", "2.0", "3.0"} <= set(e["slo_attainment"])
    main = {e["policy"] for e in entries if e["table"] == "km" and e["workload"] == "wideresnet/cv4"}
    assert {"quart", "oracle", "static-1", "static-2", "static-3", "inferline", "cocktail"} <= main
    assert "static-4" not in main  # static-k stops at the per-stage cap
    assert {e["policy"] for e in entries if e["table"] == "no-km"} >= {"inferline", "infless", "cocktail"}
    rows = {r["workload"]: r for r in doc["summary"]}
    assert all(e["seed"] == 0 for e in entries)
    assert set(rows) == {"wideresnet/cv4", *windows}
    for r in rows.values():
        assert {"frontier_mean_ms", "quart_over_frontier", "cheaper_baselines", "quart_over_oracle",
                "targets_met"} <= set(r)
    assert (plots / "frontier-wideresnet.png").stat().st_size > 0
    # --reuse: baselines and static-k come from the earlier document unchanged; QUART and the oracle run again
    again = tmp_path / "again.json"
    rc = cli.main(["--experiment", "frontier", "--quick", "--models", "wideresnet", "--cvs", "4",
                   "--trace", _trace(tmp_path / "trace.csv"), "--max-replicas", "3", "--workers", "2",
                   "--reuse", str(out), "--out", str(again)])
    assert rc == 0
    redo = json.loads(again.read_text())["entries"]
    assert [(e["workload"], e["policy"], e["table"]) for e in redo] == [
        (e["workload"], e["policy"], e["table"]) for e in entries]
    assert [e for e in redo if e["policy"] != "oracle"] == [e for e in entries if e["policy"] != "oracle"]
    other = cli.main(["--experiment", "frontier", "--quick", "--models", "wideresnet", "--cvs", "1", "--no-trace",
                      "--reuse", str(out), "--out", str(tmp_path / "x.json")])
    assert other == 2 and not (tmp_path / "x.json").exists()  # a different configuration is refused


def test_quart_ablation_runs_every_variant(tmp_path) -> None:
    out = tmp_path / "ablation.json"
    rc = cli.main(["--experiment", "quart-ablation", "--quick", "--models", "wideresnet", "--cvs", "4", "--no-trace",
                   "--max-replicas", "3", "--workers", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["quart", "-smooth", "-cpu", "+cpu-allocate", "-key-placement", "-keysmanager", "pid"]
    by = {r["policy"]: r for r in rows}
    # cold starts instead of forks: seconds, not tens of ms, for the CPU bridge to cover (CPU-seconds, not replicas)
    assert by["-keysmanager"]["cpu_seconds"] - by["-keysmanager"]["replica_seconds"] > \
        by["quart"]["cpu_seconds"] - by["quart"]["replica_seconds"] > 0
    assert by["-cpu"]["cpu_seconds"] < by["quart"]["cpu_seconds"]  # no compensation: 1 CPU per replica


def test_frontier_over_seeds_and_trace_windows(tmp_path) -> None:
    """--seeds: every entry carries its seed, the summary has one row per (workload, seed) and over_seeds the mean
    and worst; --only-trace (and --cvs "") runs the trace's windows, each at its own time scale."""
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(600):  # 150 s: bursts every 2 s, quieter after 60 s, busy again after 100 s
        if 60 <= i // 4 < 100 and i % 4:
            continue
        t = t0 + timedelta(seconds=i // 4, milliseconds=(i % 4) * 50)
        rows.append(f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,100,10")
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "seeds.json"
    rc = cli.main(["--experiment", "frontier", "--quick", "--models", "wideresnet", "--cvs", "", "--only-trace",
                   "--trace", str(trace), "--seeds", "0,1", "--max-replicas", "2", "--workers", "1", "--out", str(out),
                   "--plots", str(tmp_path / "plots")])
    assert rc == 0
    assert (tmp_path / "plots" / "frontier-seeds.png").stat().st_size > 0  # QUART / frontier and / oracle by seed
    doc = json.loads(out.read_text())
    assert doc["config"]["seeds"] == [0, 1]
    names = {"wideresnet/trace-busy", "wideresnet/trace-quiet", "wideresnet/trace-step"}
    assert {e["workload"] for e in doc["entries"]} == names
    assert {e["seed"] for e in doc["entries"]} == {0, 1}
    assert {(r["workload"], r["seed"]) for r in doc["summary"]} == {(w, s) for w in names for s in (0, 1)}
    for agg in doc["over_seeds"]:
        assert agg["seeds"] == [0, 1]
        by_seed = [v for v in agg["quart_over_frontier_by_seed"].values() if v is not None]
        if by_seed:
            assert agg["quart_over_frontier_worst"] == max(by_seed)
            assert agg["quart_over_frontier_mean"] == pytest.approx(sum(by_seed) / len(by_seed))
        assert set(agg["targets_met"]) == {"frontier_mean", "frontier_worst", "oracle_worst", "cheaper_baselines"}
    assert cli.main(["--experiment", "frontier", "--quick", "--cvs", "", "--no-trace", "--out",
                     str(tmp_path / "none.json")]) == 2  # no workload: refused, named
    assert cli.main(["--experiment", "frontier", "--quick", "--seeds", "a,b", "--out", str(tmp_path / "x.json")]) == 2

"""`quartctl simulate --experiment blitzscale` (issue 16 item 5, issue 17 item 5): one burst, every start mode,
at the BlitzScale fabric, on the simulated cluster driven by the live controller. Seconds."""

from __future__ import annotations

import json

import pytest
from quart_tools.sim.blitzscale import FABRIC, MODES, fabric_calibration, run_blitzscale
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.cli import main

KEYS = {"mode", "ready_ms", "first_served_ms", "burst_mean_ms", "burst_p99_ms"}


@pytest.fixture(scope="module")
def doc() -> dict:
    return run_blitzscale(["llama2-7b"], Calibration.load("tools/sim/calibration.live.json"), warm_s=20.0,
                          burst_s=20.0, cool_s=10.0)


def test_every_mode_one_row_on_the_same_arrivals(doc: dict) -> None:
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == set(MODES)
    assert all(KEYS <= set(r) for r in rows.values())
    assert len({r["burst_requests"] for r in rows.values()}) == 1  # the same burst for every mode
    assert all(r["burst_unfinished"] == 0 for r in rows.values())
    assert doc["simulated"] is True and doc["fabric"] == FABRIC


def test_start_modes_rank_as_their_data_paths(doc: dict) -> None:
    r = {row["mode"]: row for row in doc["rows"]}
    # stop-the-world loads: storage (10 Gbit/s) > one source's NIC shared by a star > a chain > host cache
    assert r["registry-cold"]["ready_ms"] > r["peer-fetch"]["ready_ms"] > r["multicast"]["ready_ms"]
    assert r["multicast"]["ready_ms"] > r["allcache"]["ready_ms"]
    assert r["multicast"]["last_ready_ms"] <= 1.05 * r["multicast"]["ready_ms"]  # the chain's last ≈ its first
    # live serves from its first layer on: far before any full load
    assert r["live"]["first_served_ms"] <= 0.25 * r["peer-fetch"]["ready_ms"]
    assert r["live"]["burst_p99_ms"] < r["multicast"]["burst_p99_ms"] < r["registry-cold"]["burst_p99_ms"]
    # ParaServe splits the cold start: sooner than one host loading it all
    assert r["paraserve"]["first_served_ms"] < 0.5 * r["registry-cold"]["first_served_ms"]
    check = doc["check_live_p99_within_1.2x_allcache"]["llama2-7b"]
    assert check["live_p99_over_allcache"] == pytest.approx(r["live"]["burst_p99_ms"] / r["allcache"]["burst_p99_ms"])


def test_fabric_is_the_papers() -> None:
    cal = fabric_calibration(Calibration(), "llama2-70b")
    assert cal.nic_gbytes_s == 12.5 and cal.h2d_gbps == 16.0 and cal.disk_gbps == 1.25
    assert cal.hosts == 16 and cal.gpus_per_host == 1 and cal.live_layers == 20


def test_cli_writes_the_rows(tmp_path) -> None:
    out = tmp_path / "b.json"
    assert main(["--experiment", "blitzscale", "--models", "llama2-7b", "--out", str(out),
                 "--plots", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    assert doc["experiment"] == "blitzscale" and len(doc["rows"]) == len(MODES)
    assert (tmp_path / "blitzscale-llama2-7b.png").stat().st_size > 0
    assert main(["--experiment", "blitzscale", "--models", "gpt-5", "--out", str(out)]) == 2  # names the field

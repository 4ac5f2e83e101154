"""The ParaServe bench's pieces that need no namespaces: the planner's calibration from the rows' worker timelines
(no measured row is predicted faster than it ran) and the files registry (S3 GetObject with ``Range`` through
the product's own registry client)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from quart_tools.bench.paraserve import calibrate, predictions
from quart_tools.bench.s3files import make_app

from keysmanager.registry import ModelRegistry, RegistryError

GB = 1_000_000_000


def _rows() -> list[dict]:
    """P = 1 at 1 Gbit/s, P = 2 and P = 4 with their workers' marks (ms) as a run records them."""
    return [
        {"P": 1, "first_served_ms": 9300.0, "workers": {"h0": {"fetch_begin": 60.0, "whole": 9060.0}}},
        {"P": 2, "first_served_ms": 5100.0, "workers": {
            h: {"requested": 250.0, "fetch_begin": 260.0, "routable": 1200.0, "part_held": 4800.0,
                "part_bytes": GB // 2} for h in ("h0", "h1")}},
        {"P": 4, "first_served_ms": 4100.0, "workers": {
            h: {"requested": 150.0, "fetch_begin": 160.0, "routable": 1900.0 + 10 * i, "part_held": 3000.0 + 200 * i,
                "part_bytes": GB // 4} for i, h in enumerate(("h0", "h1", "h2", "h3"))}},
    ]


def test_calibration_is_never_optimistic_about_a_measured_row() -> None:
    rows = _rows()
    cal = calibrate(rows, GB)
    assert cal.fetch_bytes_s == pytest.approx((GB // 4) / 3.44)  # the slowest worker: h3 of P = 4
    assert cal.fixed_s == pytest.approx(1.78)  # h3 of P = 4: requested → routable
    predicted = predictions(cal, [GB // 8] * 8, 4 * GB / 8, 4)  # 8 equal layers: P = 3 gets 3 of them
    for row in rows:
        assert predicted[row["P"]] >= row["first_served_ms"] - 1e-6, (row["P"], predicted)
    assert predicted[1] > predicted[2] > predicted[3] > predicted[4]
    assert predicted[3] == pytest.approx(1000 * (3 * GB / 8 / cal.fetch_bytes_s + cal.tail_s), abs=5)  # 3 of 8 (+ hops)
    with pytest.raises(RuntimeError):
        calibrate([{"P": 1, "first_served_ms": 1.0, "workers": {}}], GB)


@pytest.fixture
def files_registry(tmp_path, monkeypatch):
    """The files registry on an ephemeral port, over a model folder of one 3 MB object and a manifest."""
    from aiohttp import web

    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    data = os.urandom(3 << 20)
    (folder / "stage-0.safetensors").write_bytes(data)
    (folder / "manifest.json").write_text('{"model": "m"}')
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(tmp_path))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site.port
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", data
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_files_registry_serves_ranges_and_s3_errors(files_registry, tmp_path) -> None:
    endpoint, data = files_registry
    registry = ModelRegistry("s3://models/m", endpoint_url=endpoint)
    assert registry.manifest() == {"model": "m"}
    assert b"".join(registry.read_range("stage-0.safetensors", 1000, 2_500_000)) == data[1000:2_500_000]
    result = registry.fetch("stage-0.safetensors", tmp_path / "out")
    assert result.nbytes == len(data) and (tmp_path / "out").read_bytes() == data
    with pytest.raises(RegistryError, match="no such object"):
        registry.fetch("../../etc/passwd", tmp_path / "x")
    with pytest.raises(RegistryError, match="does not exist"):
        ModelRegistry("s3://nope/m", endpoint_url=endpoint).manifest()

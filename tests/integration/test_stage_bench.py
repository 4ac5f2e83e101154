"""`quartctl bench serialization` runs and writes the documented JSON."""

from __future__ import annotations

import json

from quart_tools.cli import main


def test_bench_serialization_writes_rows(tmp_path, capsys):
    out = tmp_path / "ser.json"
    assert main(["bench", "serialization", "--sizes", "1,4", "--repeats", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serialization" and doc["machine"]["cpus"] >= 1
    assert [r["mb"] for r in doc["rows"]] == [1.0, 4.0]
    for row in doc["rows"]:
        assert {"mb", "serde_gbps", "copy_gbps", "ratio"} <= set(row)
        assert row["serde_gbps"] > 0 and row["copy_gbps"] > 0
        assert row["ratio"] == round(row["serde_gbps"] / row["copy_gbps"], 3) or abs(
            row["ratio"] - row["serde_gbps"] / row["copy_gbps"]) < 0.01
    assert "ratio" in capsys.readouterr().err

"""Terminal tables of ``quartctl list`` and ``quartctl status`` (rich; plain text when not a terminal)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    return Console(soft_wrap=False, width=None if Console().is_terminal else 160)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    out = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        out.add_column(column, overflow="fold")
    for row in rows:
        out.add_row(*("" if cell is None else str(cell) for cell in row))
    return out


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    _console().print(table(title, columns, rows))


def _replicas(stage: dict) -> str:
    by = [f"{r['host']}:{r['source']}" + ("" if r["state"] == "ready" else f"({r['state']})")
          for r in stage.get("replicas", [])]
    return " ".join(by) or "-"


def print_status(doc: dict, url: str) -> None:
    """The status document (:func:`gateway_plugin.status.status_document`) as tables."""
    console = _console()
    hosts = ", ".join(f"{h['name']} {h['used']}/{h['slots'] if h['slots'] is not None else '?'}"
                      for h in doc["hosts"])
    console.print(f"Gateway {url}  policy {doc['policy']}  control period {doc['control_period_s']} s  "
                  f"hosts (used/slots): {hosts or 'none'}")
    if not doc["pipelines"]:
        console.print("No pipeline is deployed.")
    for p in doc["pipelines"]:
        lat = p["latency"]
        rows = [(s["index"], s["name"], s["queue"], f"{s['arrival_rate']:.2f}", f"{s['service_rate']:.2f}",
                 f"{s.get('ready', '-')}/{s.get('desired', '-')}", f"{s.get('min', '-')}-{s.get('max', '-')}",
                 "yes" if s["index"] in p["key_stages"] else "", _replicas(s), s.get("reason", ""))
                for s in p["stages"]]
        console.print(table(
            f"{p['model']}: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms over {lat['window_s']:g} s "
            f"({lat['count']} requests)",
            ("#", "stage", "queue", "λ/s", "μ/s", "ready/desired", "min-max", "key", "replicas host:source",
             "not ready because"), rows))
        decisions = [(f"{d['age_s']:.1f}", " ".join(map(str, d["desired"])), " ".join(map(str, d["replicas"])),
                      " ".join(map(str, d["queue"])), ",".join(map(str, d["key_stages"])) or "-",
                      "; ".join(r for r in d["reasons"] if r) or "-") for d in p["decisions"][:5]]
        console.print(table(f"{p['model']}: last decisions", ("age s", "desired", "ready", "queue", "key",
                                                               "reasons"), decisions))

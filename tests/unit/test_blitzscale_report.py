"""`quartctl bench blitzscale`'s arithmetic: one-shot ratios per run and the runs meeting both targets; the
rounds' alternating mode order; the receivers' CPU per GB; the generation rows' TTFT (sessions from t0 on), TBT (tokens from t0 on), steady TBT (before t0), wrong and lost."""

from __future__ import annotations

import argparse

from quart_tools.bench.blitzscale import receiver_cpu, round_order, runs_report
from quart_tools.bench.blitzscale_gen import Stream, report, summarize
from quart_tools.bench.blitzscale_timeline import fluid_bound


def test_runs_report_counts_the_runs_meeting_both_targets() -> None:
    rows = []
    for run, (mc, live) in enumerate([(1.2, 0.5), (1.4, 0.5), (1.25, 0.7)]):
        rows += [{"run": run, "mode": "peer-fetch", "ready_ms": 1000.0, "burst_p99_ms": 100.0},
                 {"run": run, "mode": "multicast-4", "ready_ms": 1000.0 * mc, "burst_p99_ms": 1.0},
                 {"run": run, "mode": "live", "ready_ms": 900.0, "burst_p99_ms": 100.0 * live}]
    out = runs_report(rows, 3)
    assert out["runs_meeting_targets"] == "1 of 3"
    assert out["ratios"][1] == {"multicast4_ready_over_peer_fetch": 1.4, "live_burst_p99_over_peer_fetch": 0.5}
    assert runs_report(rows[:3], 1)["ratios"]["multicast4_ready_over_peer_fetch"] == 1.2


def test_rounds_alternate_the_order_of_the_modes() -> None:
    modes = ["live", "multicast-4", "peer-fetch"]  # as given: the rounds follow the bench's own order
    assert round_order(modes, 0) == ["peer-fetch", "multicast-4", "live"]
    assert round_order(modes, 1) == ["live", "multicast-4", "peer-fetch"]
    assert round_order(modes, 2) == round_order(modes, 0)


def test_receiver_cpu_counts_the_hosts_that_worked_per_gb() -> None:
    before = {"h1": 10.0, "h2": 5.0, "h3": 7.0}
    after = {"h1": 12.0, "h2": 5.1, "h3": 8.0, "h4": 3.0}  # h2 idled; h4 restarted meanwhile (not counted)
    out = receiver_cpu(before, after, 2_000_000_000)
    assert out == {"receiver_cpu_s": {"h1": 2.0, "h3": 1.0}, "receiver_cpu_s_per_gb": 0.75}
    assert receiver_cpu(before, before, 10) == {"receiver_cpu_s": {}, "receiver_cpu_s_per_gb": None}


def test_generation_rows_split_ttft_and_tbt_at_the_scale_up() -> None:
    t0 = 10.0
    steady = Stream(arrived=8.0, burst=False, expected=[1, 2, 3], times=[8.5, 8.6, 8.7], tokens=[1, 2, 3])
    across = Stream(arrived=9.8, burst=False, expected=[4, 5, 6], times=[9.9, 10.0, 10.3], tokens=[4, 5, 6])
    late = Stream(arrived=10.0, burst=True, expected=[7, 8], times=[11.0, 11.1], tokens=[7, 9], split=True)
    lost = Stream(arrived=10.5, burst=True, expected=[1], error="502: stage failed")
    row = summarize("live", [steady, across, late, lost], steady_from=8.0, t0=t0, whole_at=12.0, shadows=1)
    assert row["ttft_p99_ms"] == 1000.0  # only sessions that arrived from t0 on (the lost one has no first token)
    assert row["tbt_samples"] == 3 and row["tbt_p99_ms"] == 300.0 and row["split_tbt_p99_ms"] == 100.0
    assert row["steady_tbt_p99_ms"] == 100.0
    assert (row["completed"], row["lost"], row["wrong"], row["ready_ms"]) == (3, 1, 1, 2000.0)
    args = argparse.Namespace(decode_ms=80, prefill_ms_per_token=1, prompt_tokens=64, max_tokens=16, kv_sessions=6,
                              slots=32, steady_rate=2, steady_s=5, gen_rate=5, gen_burst_s=8, retry_ms=20,
                              rejoin="shadow", room_wait_s=30, recut="on")
    peer = dict(row, mode="peer-fetch", ttft_p99_ms=4000.0)
    doc = report([peer, row], args)
    assert doc["ratios"] == {"live_ttft_p99_over_peer_fetch": 0.25, "live_tbt_p99_over_steady": 3.0}


def test_modes_default_to_every_mode_and_take_commas(monkeypatch) -> None:
    from quart_tools.bench import blitzscale

    seen = []

    def measure(args):
        seen.append(args.modes)
        raise SystemExit(0)

    monkeypatch.setattr(blitzscale, "measure", measure)
    for argv in ([], ["--modes", "multicast-4,peer-fetch,live"], ["--modes", "live", "allcache"]):
        try:
            blitzscale.main(argv)
        except SystemExit:
            pass
    assert seen == [list(blitzscale.MODES), ["multicast-4", "peer-fetch", "live"], ["live", "allcache"]]


def test_generation_rounds_each_get_their_ratios_and_the_rounds_meeting_both_targets_are_counted() -> None:
    args = argparse.Namespace(decode_ms=80, prefill_ms_per_token=1, prompt_tokens=64, max_tokens=16, kv_sessions=6,
                              slots=32, steady_rate=2, steady_s=5, gen_rate=5, gen_burst_s=8, retry_ms=20,
                              rejoin="migrate", room_wait_s=30, recut="on")
    rows = []
    for run, (live_ttft, live_tbt) in enumerate([(1000.0, 120.0), (2500.0, 110.0), (900.0, 160.0)]):
        rows += [{"mode": "peer-fetch", "run": run, "ttft_p99_ms": 4000.0, "tbt_p99_ms": 90.0, "steady_tbt_p99_ms": 100.0},
                 {"mode": "live", "run": run, "ttft_p99_ms": live_ttft, "tbt_p99_ms": live_tbt,
                  "steady_tbt_p99_ms": 100.0}]
    doc = report(rows, args)
    assert [r["live_ttft_p99_over_peer_fetch"] for r in doc["ratios"]] == [0.25, 0.625, 0.225]
    assert [r["live_tbt_p99_over_steady"] for r in doc["ratios"]] == [1.2, 1.1, 1.6]
    assert doc["runs_meeting_targets"] == "1 of 3"


def test_the_benchs_expected_tokens_are_the_emulated_stages_own() -> None:
    from quart_stage.kvmigrate import EmulatedKV
    from quart_tools.bench.blitzscale_gen import expected_tokens

    prompt, seed, vocab = [5, 9, 2, 7], 1234, 1000
    state, got = EmulatedKV(seed, 4), []  # as a stage replica steps an emulated session: append the ids, then answer
    state.append(prompt, range(1, 3))
    while len(got) < 6:
        got.append(state.token(vocab))
        state.append([got[-1]], range(1, 3))
    assert expected_tokens(prompt, 6, seed, vocab) == got and len(set(got)) > 1


def test_fluid_bound_admits_by_the_live_share_and_measures_the_line() -> None:
    rows = [[t / 4, 0.0] for t in range(0, 41)]  # 10 s, no live replica: 6 / 1.5 = 4 sessions/s
    out = fluid_bound(rows, lambda t: 6 * t, 6, 1.5, 1.5)
    assert out["admitted"][-1] == 40.0  # 4/s for 10 s, of 60 arrived
    assert out["left_waiting"] == 20.0
    assert out["longest_wait_s"] > 3.0  # the line grows 2/s: those admitted last waited 10 - 40/6 s
    whole = fluid_bound([[t / 4, 1.0] for t in range(0, 41)], lambda t: 6 * t, 6, 1.5, 1.5)
    assert whole["left_waiting"] == 0.0 and whole["longest_wait_s"] <= 0.25

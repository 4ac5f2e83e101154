"""The progress file of a stage still arriving (``quart_stage.progress``): both formats, and a reader racing the
writer never sees a torn value or a range that shrinks (each write replaces the file whole), so a live replica
never runs a layer that is not verified."""

from __future__ import annotations

import multiprocessing
import struct

from quart_stage.layers import LiveProgress
from quart_stage.progress import read_progress, read_range, write_progress, write_range


def test_formats_and_never_shrinking(tmp_path) -> None:
    path = str(tmp_path / "p.layers")
    assert read_range(path) == (0, 0) and read_progress(path) == 0
    write_progress(path, 3)
    assert read_range(path) == (0, 3) and read_progress(path) == 3
    write_progress(path, 2)  # never lowers
    assert read_progress(path) == 3
    part = str(tmp_path / "q.layers")
    write_range(part, 4, 6)
    assert read_range(part) == (4, 6) and read_progress(part) == 0  # a range not from 0 is no prefix
    for lo, hi in [(5, 7), (4, 5), (6, 6)]:  # not containing the current range, or empty: ignored
        write_range(part, lo, hi)
        assert read_range(part) == (4, 6)
    write_range(part, 3, 8)
    assert read_range(part) == (3, 8)
    with open(part, "wb") as f:  # a short file (never written so; read as nothing held)
        f.write(struct.pack("<I", 9))
    assert read_range(part) == (0, 0)


LAYERS, FIRST = 3000, 1500  # many small steps: many chances to race


def _grow(path: str) -> None:
    """A part fetch's writer: layer FIRST first, then the range grows both ways one layer at a time."""
    lo, hi = FIRST, FIRST + 1
    write_range(path, lo, hi)
    while (lo, hi) != (0, LAYERS):
        lo, hi = (lo - 1, hi) if lo > 0 and (hi == LAYERS or hi % 2) else (lo, hi + 1)
        write_range(path, lo, hi)


def test_a_reader_racing_the_writer_sees_only_written_ranges_that_only_grow(tmp_path) -> None:
    path = str(tmp_path / "stage.part-1-0.layers")
    writer = multiprocessing.get_context("fork").Process(target=_grow, args=(path,))
    writer.start()
    progress = LiveProgress(path, 10, 10 + LAYERS)
    seen, reads = (10, 10), 0
    try:
        while writer.is_alive() or reads < 1000:
            lo, hi = read_range(path)
            assert (lo, hi) == (0, 0) or 0 <= lo <= FIRST < hi <= LAYERS, (lo, hi)  # never torn
            held = progress.held()
            assert seen == (10, 10) or held[0] <= seen[0] and seen[1] <= held[1], (seen, held)  # never shrinks
            seen, reads = held, reads + 1
    finally:
        writer.join(30)
    assert writer.exitcode == 0 and reads > 1000
    assert progress.held() == (10, 10 + LAYERS) and progress.full

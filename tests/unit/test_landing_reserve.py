"""The landing reserve (``keysmanager.landing``): filled in the background to its size, handed to a new stage file
by rename and cut to the stage's size, never over a file that exists, refilled after a quiet spell, removed on
stop; and a ``VerifiedWriter`` that lands in it writes, verifies and commits the same bytes as one that does not."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from quart_stage.progress import read_progress

from keysmanager import landing as landing_module
from keysmanager.landing import LandingReserve
from keysmanager.transfer import LayerCheck, TransferError, VerifiedWriter


def _filled(reserve: LandingReserve, timeout_s: float = 10.0) -> LandingReserve:
    reserve.start()
    deadline = time.monotonic() + timeout_s
    while reserve.state != "ready":
        assert time.monotonic() < deadline, reserve.summary()
        time.sleep(0.005)
    return reserve


def test_off_when_zero_bytes(tmp_path: Path) -> None:
    reserve = LandingReserve(tmp_path / "landing", 0)
    reserve.start()
    assert reserve.state == "off" and not (tmp_path / "landing").exists()
    assert reserve.take(tmp_path / "x.partial", 100) == 0 and not (tmp_path / "x.partial").exists()


def test_fills_to_its_size_with_zeros_and_drops_a_stale_reserve(tmp_path: Path) -> None:
    (tmp_path / "landing").mkdir()
    (tmp_path / "landing" / "reserve").write_bytes(b"stale" * 1000)
    reserve = _filled(LandingReserve(tmp_path / "landing", 3 * landing_module.FILL_CHUNK + 12345))
    data = reserve.path.read_bytes()
    assert len(data) == reserve.nbytes and data.count(0) == len(data)
    assert reserve.summary() == {"state": "ready", "bytes": reserve.nbytes, "target_bytes": reserve.nbytes, "taken": 0}


@pytest.mark.parametrize("size", [1 << 20, (8 << 20) + 7])  # smaller than the reserve (cut), larger (grows)
def test_take_renames_the_reserve_to_the_stage_file_cut_to_size(tmp_path: Path, size: int) -> None:
    reserve = _filled(LandingReserve(tmp_path / "landing", 4 << 20))
    inode = reserve.path.stat().st_ino
    dest = tmp_path / "stage.bin.partial"
    assert reserve.take(dest, size) == min(size, 4 << 20)
    assert dest.stat().st_ino == inode and dest.stat().st_size == size
    assert not reserve.path.exists() and reserve.state == "filling" and reserve.summary()["taken"] == 1
    assert reserve.take(tmp_path / "other.partial", size) == 0  # nothing left until it is refilled


def test_take_never_replaces_a_file_that_exists(tmp_path: Path) -> None:
    reserve = _filled(LandingReserve(tmp_path / "landing", 1 << 20))
    dest = tmp_path / "stage.bin.partial"
    dest.write_bytes(b"an earlier attempt's verified layers")
    assert reserve.take(dest, 1 << 20) == 0
    assert dest.read_bytes() == b"an earlier attempt's verified layers" and reserve.state == "ready"


def test_refilled_once_no_transfer_ran_for_the_quiet_time(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(landing_module, "REFILL_AFTER_S", 0.3)
    reserve = _filled(LandingReserve(tmp_path / "landing", 1 << 20))
    reserve.take(tmp_path / "a.partial", 1 << 20)
    reserve.refill_later()
    time.sleep(0.1)
    assert reserve.filled == 0  # not during the quiet time (a burst may still be on)
    deadline = time.monotonic() + 10
    while reserve.state != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reserve.stop()
    assert not reserve.path.exists() and reserve.filled == 0


def test_a_take_during_the_fill_gets_what_was_touched(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(landing_module, "FILL_CHUNK", 1 << 16)
    reserve = LandingReserve(tmp_path / "landing", 256 << 20)
    reserve.start()
    while reserve.filled == 0:
        time.sleep(0.001)
    got = reserve.take(tmp_path / "a.partial", 1 << 20)
    assert 0 < got <= 1 << 20 and (tmp_path / "a.partial").stat().st_size == 1 << 20


def _write(writer: VerifiedWriter, data: bytes, step: int = 1 << 20) -> None:
    for at in range(0, len(data), step):
        writer.write(data[at:at + step])


def test_a_writer_lands_in_the_reserve_and_commits_the_same_bytes(tmp_path: Path) -> None:
    data = os.urandom((3 << 20) + 999)
    reserve = _filled(LandingReserve(tmp_path / "landing", 8 << 20))
    inode = reserve.path.stat().st_ino
    with VerifiedWriter(tmp_path / "stage.bin", hashlib.sha256(data).hexdigest(), len(data), landing=reserve) as w:
        assert w.pretouched == len(data)
        _write(w, data)
        w.commit()
    out = tmp_path / "stage.bin"
    assert out.read_bytes() == data and out.stat().st_ino == inode
    assert not (tmp_path / "stage.bin.partial").exists()


def test_a_corrupt_transfer_into_the_reserve_leaves_nothing(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    reserve = _filled(LandingReserve(tmp_path / "landing", 2 << 20))
    with pytest.raises(TransferError, match="checksum mismatch"):
        with VerifiedWriter(tmp_path / "stage.bin", "0" * 64, len(data), landing=reserve) as w:
            _write(w, data)
            w.commit()
    assert not (tmp_path / "stage.bin").exists() and not (tmp_path / "stage.bin.partial").exists()


def test_a_live_writer_lands_in_the_reserve_and_verifies_layer_by_layer(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    spans = ((0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20))
    check = LayerCheck(spans, tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in spans), tmp_path / "progress")
    reserve = _filled(LandingReserve(tmp_path / "landing", 4 << 20))
    with VerifiedWriter(tmp_path / "stage.bin", hashlib.sha256(data).hexdigest(), len(data), layers=check,
                        landing=reserve) as w:
        assert w.pretouched == len(data) and w.partial.stat().st_size == len(data)  # mappable whole at once
        w.write(data[:1 << 20])
        assert read_progress(str(check.progress)) == 1
        w.write(data[1 << 20:])
        w.commit()
    assert (tmp_path / "stage.bin").read_bytes() == data and read_progress(str(check.progress)) == 3

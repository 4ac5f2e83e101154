"""Async-call bodies on disk (quart_provider.async_bodies): an upload a killed gateway never finished is a
``.part`` file, removed when the next gateway opens the folder; whole bodies (named by queued calls) stay."""

from __future__ import annotations

import pytest
from quart_provider.async_bodies import BodyStore


def test_parts_left_by_a_killed_gateway_are_removed_and_whole_bodies_kept(tmp_path):
    folder = tmp_path / "async-bodies"
    folder.mkdir()
    (folder / "ab12.part").write_bytes(b"half an upload")
    (folder / "cd34").write_bytes(b"a whole body a queued call names")
    store = BodyStore(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["cd34"]
    assert store.path("cd34").read_bytes().startswith(b"a whole")
    with pytest.raises(ValueError):
        store.path("../cd34")

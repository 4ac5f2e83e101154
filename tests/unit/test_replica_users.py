"""Issue 31 item 6: replicas run unprivileged by default where the platform can.

``replica_uids = "auto"`` (the default): a root gateway gives each function its own uid, unless an
unprivileged user could not run the interpreter or read the project (then it says which path is in the way).
The drop itself is covered by tests/integration/test_isolation.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from quart_provider.config import GatewayConfig
from quart_provider.replica_users import AUTO_REPLICA_UIDS, auto_uids, blocked_path


def test_blocked_path_names_the_folder_others_cannot_search(request):
    tmp_path = Path(tempfile.mkdtemp(prefix="quart-users-", dir="/tmp"))  # pytest's own tmp_path is 0700
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    open_dir = tmp_path / "open"
    (open_dir / "in").mkdir(parents=True)
    tmp_path.chmod(0o755)
    open_dir.chmod(0o755)
    (open_dir / "in").chmod(0o700)
    target = open_dir / "in" / "f.py"
    target.write_text("x = 1\n")
    target.chmod(0o644)
    if blocked_path(tmp_path) is not None:
        pytest.skip(f"{tmp_path} sits in a folder others cannot search")
    assert blocked_path(target) == open_dir / "in"
    (open_dir / "in").chmod(0o755)
    assert blocked_path(target) is None
    target.chmod(0o600)
    assert blocked_path(target) == target


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give replicas other uids")
def test_auto_gives_per_function_uids_when_the_interpreter_is_reachable_and_says_why_not_otherwise(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    python = hidden / "python3"
    python.write_text("")
    uids, why = auto_uids(str(python))
    assert uids is None and "hidden" in why and "QUART_GATEWAY_REPLICA_UIDS" in why
    if blocked_path("/usr/bin/python3") is None and all(
            blocked_path(p) is None for p in (__import__("quart_stage").__file__,)):
        uids, _ = auto_uids("/usr/bin/python3")
        assert uids == AUTO_REPLICA_UIDS and 0 not in uids


def test_the_default_is_auto_and_an_empty_setting_keeps_the_gateways_user():
    assert GatewayConfig().replica_uids == "auto"
    assert GatewayConfig(replica_uids="").uid_range() is None
    assert GatewayConfig(replica_uids="300000-300009").uid_range() == range(300000, 300010)

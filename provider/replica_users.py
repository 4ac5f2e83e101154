"""Which uids replicas run as by default (issue 31, item 6): never root when the platform can avoid it.

``GatewayConfig.replica_uids = "auto"`` (the default): a gateway running as root gives each function its own
uid from :data:`AUTO_REPLICA_UIDS` (:mod:`quart_stage.privdrop` drops to it), provided an unprivileged user
can run the interpreter and read the project's packages (every folder on their paths searchable by others,
the files readable); else replicas run as the gateway's user and :func:`auto_uids` says which path stands in
the way (``chmod o+rx`` it, or install the venv elsewhere). A gateway that is not root cannot switch users.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path

AUTO_REPLICA_UIDS = range(200_000, 265_536)  # one uid per function (gid = uid)
PACKAGES = ("quart_stage", "quart_provider", "quart_transport", "keysmanager")  # what a replica imports (quart/echo: http1)


def blocked_path(path: str | os.PathLike) -> Path | None:
    """The first folder on ``path``'s real path that others cannot search, or the file if others cannot
    read it; None when an unprivileged user can reach it."""
    real = Path(os.path.realpath(path))
    for folder in reversed(real.parents):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None if os.stat(real).st_mode & stat.S_IROTH else real


def auto_uids(executable: str = sys.executable) -> tuple[range | None, str]:
    """The uid range ``auto`` means here, and why not one when it is None."""
    if os.geteuid() != 0:
        return None, "the gateway is not root: replicas run as its user"
    paths = [executable]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            paths.append(spec.origin)
    for path in paths:
        try:
            blocked = blocked_path(path)
        except OSError as exc:
            return None, f"{path} cannot be checked ({exc})"
        if blocked is not None:
            return None, (f"replicas run as root: an unprivileged user cannot reach {path} ({blocked} is not "
                          "readable/searchable by others); chmod o+rx it or set QUART_GATEWAY_REPLICA_UIDS")
    return AUTO_REPLICA_UIDS, f"replicas run as their own uids {AUTO_REPLICA_UIDS.start}-{AUTO_REPLICA_UIDS.stop - 1}"

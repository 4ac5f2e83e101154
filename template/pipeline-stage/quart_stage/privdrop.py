"""Replicas run as an unprivileged user (issue 14, item 4): the platform names it, the replica drops to it.

The gateway gives each function its own uid from ``GatewayConfig.replica_uids`` (gid = uid) and puts
``QUART_RUN_AS=<uid>:<gid>`` in its replicas' environment (a deploy cannot set it:
:mod:`quart_stage.envpolicy`). The process that becomes the replica — a process runnable between fork
and exec, a KeysManager replica forked from its zygote or started cold, after its parameters are mapped
and its device prepared but before it serves a request — calls :func:`drop_from_env`: supplementary
groups cleared, then gid, then uid, and a check that root cannot be regained. From there the replica
cannot open the KeysManager's socket (0600 in a 0700 folder), the gateway's state folder (0700), nor
another function's secrets (a per-replica folder owned by that function's uid, 0700).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RUN_AS_ENV = "QUART_RUN_AS"


def parse_run_as(value: str) -> tuple[int, int]:
    """``"<uid>:<gid>"`` (or ``"<uid>"``: gid = uid) → (uid, gid); ValueError when malformed or root."""
    uid_text, _, gid_text = value.partition(":")
    uid, gid = int(uid_text), int(gid_text or uid_text)
    if uid <= 0 or gid <= 0:
        raise ValueError(f"{RUN_AS_ENV}={value!r}: a replica never runs as root (uid/gid must be > 0)")
    return uid, gid


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` for good (no supplementary groups). Raises OSError/RuntimeError when not done."""
    if os.getuid() == uid and os.geteuid() == uid and os.getgid() == gid:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or os.getgroups() not in ([], [gid]):
        raise RuntimeError(f"dropping to uid {uid} gid {gid} did not take")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise RuntimeError("root could be regained after dropping privileges")


def drop_from_env(env: Mapping[str, str]) -> bool:
    """Drop to ``QUART_RUN_AS`` when the environment names one; True when it did."""
    value = env.get(RUN_AS_ENV)
    if not value:
        return False
    drop_privileges(*parse_run_as(value))
    return True

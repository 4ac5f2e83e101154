"""Deployments that survive a gateway restart (issue 14, item 2): one file per function, written atomically.

``<state>/functions/<name>.json`` (folder 0700, files 0600) holds the deploy request as faas-cli sent it
(``FunctionDeployment.to_request``), the desired replicas and the creation time. Every change the
registry makes (deploy, update, scale, remove) rewrites that one file: written to a temporary file,
``fsync``-ed, renamed over the old one, and the folder ``fsync``-ed, so a crash at any point leaves the
old or the new document, never half of one. ``quartctl up`` on the same state folder restores them
(:meth:`.registry.Registry.restore`); secrets already live as files in ``<state>/function-secrets``.

Why files and not SQLite: the control plane changes one function at a time and never needs a
transaction over several; a file per function makes each write small and independent, is readable
with ``cat``, needs no schema or migration, and has the same crash safety through ``rename`` (SQLite's
journal would buy atomic multi-row updates we do not use). A document that does not parse or validate
at restore is set aside as ``<name>.json.bad`` and named in the log, never silently dropped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("quart.store")
FUNCTIONS_DIR = "functions"  # in the gateway's state folder


def write_private(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` (mode 0600), replaced atomically and durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True, slots=True)
class StoredFunction:
    """One function as stored: its deploy request, desired replicas, creation time."""

    request: dict[str, Any]
    desired: int
    created_at: datetime
    run_as: int | None = None


class DeploymentStore:
    """The functions folder of one gateway state folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.json"  # names are DNS-1123 labels (validated at deploy)

    def save(self, name: str, request: dict[str, Any], desired: int, created_at: datetime,
             run_as: int | None = None) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        doc = {"request": request, "desired": desired, "createdAt": created_at.isoformat(), "runAs": run_as}
        write_private(self._path(name), json.dumps(doc, indent=1, sort_keys=True).encode())

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def load(self) -> list[StoredFunction]:
        """Every stored function; a document that does not parse is set aside (``.bad``) and logged."""
        if not self.folder.is_dir():
            return []
        out = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                doc = json.loads(path.read_text())
                run_as = doc.get("runAs")
                out.append(StoredFunction(dict(doc["request"]), int(doc["desired"]),
                                          datetime.fromisoformat(doc["createdAt"]),
                                          int(run_as) if run_as is not None else None))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.set_aside(path.stem, f"{type(exc).__name__}: {exc}")
        return out

    def set_aside(self, name: str, why: str) -> None:
        path = self._path(name)
        log.error("stored function %s cannot be restored (%s); kept as %s.bad", name, why, path.name)
        if path.exists():
            os.replace(path, path.with_name(path.name + ".bad"))

"""Function secrets (``/system/secrets``): stored under the gateway's state dir, given to replicas as files.

Store: ``<state>/function-secrets/<namespace>/<name>``, folders 0700, files 0600, written atomically.
A replica of a function deployed with ``secrets: [name, ...]`` gets its own copy of them, the way
OpenFaaS mounts them at ``/var/openfaas/secrets/<name>``: a per-replica folder
``<state>/function-secrets/.mounts/<replica>/`` (0700, files 0600) named by the ``QUART_SECRETS_DIR``
environment variable, removed when the replica stops. A secret's value is never logged nor put in an
error message.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from quart_stage.errors import QuartError, invalid

SECRETS_DIR_ENV = "QUART_SECRETS_DIR"  # what /var/openfaas/secrets is for an OpenFaaS function
MOUNTS = ".mounts"  # beside the namespace folders: a namespace name holds no dot
NAME_RE = re.compile(r"^[a-zA-Z0-9]([-_.a-zA-Z0-9]{0,251}[a-zA-Z0-9])?$")  # a file name; k8s Secret names fit


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_private(path: Path, data: bytes) -> None:
    """``path`` holds ``data``, mode 0600, replaced atomically (never a half-written secret)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise invalid("name", "name (the secret's name) is required")
    if ".." in name or not NAME_RE.match(name):
        raise invalid("name", f"secret name {name!r} is not valid: letters, digits, '-', '_' and '.', starting and "
                              "ending with a letter or digit, at most 253 characters")
    return name


class SecretStore:
    """The secrets of one namespace, as files."""

    def __init__(self, root: Path, namespace: str) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.folder = self.root / namespace

    def _path(self, name: str) -> Path:
        return self.folder / check_name(name)

    def names(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.iterdir() if p.is_file() and not p.name.startswith("."))

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def create(self, name: str, data: bytes) -> None:
        """A new secret; 409 when it exists (update it with PUT)."""
        if self.exists(name):
            raise QuartError(409, f"secret {name!r} already exists in namespace {self.namespace!r}; update it "
                                  "with PUT /system/secrets", "name")
        _private_dir(self.root)
        _write_private(_private_dir(self.folder) / name, data)

    def update(self, name: str, data: bytes) -> None:
        """Replace a secret's value; 404 when it does not exist. Replicas started from now on see it."""
        if not self.exists(name):
            raise self._not_found(name)
        _write_private(self._path(name), data)

    def delete(self, name: str) -> None:
        if not self.exists(name):
            raise self._not_found(name)
        self._path(name).unlink()

    def missing(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if not (NAME_RE.match(n) and ".." not in n and self.exists(n))]

    def _not_found(self, name: str) -> QuartError:
        return QuartError(404, f"secret {name!r} not found in namespace {self.namespace!r}", "name")


def mount(source: Path, names: Iterable[str], replica_id: str, owner: tuple[int, int] | None = None) -> Path:
    """Copy the secrets ``names`` of the namespace folder ``source`` into a new folder for one replica;
    with ``owner`` (uid, gid: the function's own user), that user alone may read it."""
    mounts = _private_dir(source.parent / MOUNTS)
    if owner is not None:
        os.chmod(mounts, 0o711)  # others may pass through to their own folder, never list it
    target = mounts / replica_id
    shutil.rmtree(target, ignore_errors=True)
    _private_dir(target)
    for name in names:
        _write_private(target / check_name(name), (source / name).read_bytes())
        if owner is not None:
            os.chown(target / name, *owner)
    if owner is not None:
        os.chown(target, *owner)
    return target


def unmount(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)

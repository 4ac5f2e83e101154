"""Basic auth on /system/*, with generated credentials kept like OpenFaaS's basic-auth secret.

The user name and password live in ``<state>/secrets/basic-auth-user`` and
``basic-auth-password`` (mode 0600, folder 0700), the file names OpenFaaS mounts its secret under.
They are generated once (``secrets.token_urlsafe``) and reused by later `quartctl up` runs.
The KeysManagers' bearer token of a cluster on host namespaces lives beside them
(``keysmanager-token``, same rules).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

USER_FILE = "basic-auth-user"
PASSWORD_FILE = "basic-auth-password"
DEFAULT_USER = "admin"
KEYSMANAGER_TOKEN_FILE = "keysmanager-token"


@dataclass(frozen=True, slots=True)
class Credentials:
    user: str
    password: str
    password_file: Path

    def header(self) -> str:
        """The ``Authorization`` header value a client sends."""
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return f"Basic {token}"

    def check(self, authorization: str | None) -> bool:
        """True when an ``Authorization`` header carries exactly these credentials."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "basic":  # RFC 7617 (and 7235): the scheme is case-insensitive
            return False
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return False
        user, sep, password = decoded.partition(":")
        if not sep:
            return False
        ok_user = hmac.compare_digest(user.encode(), self.user.encode())
        ok_password = hmac.compare_digest(password.encode(), self.password.encode())
        return ok_user and ok_password


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def _private_file(secrets_dir: Path, name: str, default: str) -> Path:
    """``secrets_dir/name`` (folder 0700, file 0600), written with ``default`` when absent."""
    secrets_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(secrets_dir, 0o700)
    path = secrets_dir / name
    if not path.exists():
        _write_private(path, default)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return path


def load_or_create(secrets_dir: Path) -> Credentials:
    """Read the credentials in ``secrets_dir``, generating them (mode 0600) when absent."""
    user_path = _private_file(secrets_dir, USER_FILE, DEFAULT_USER)
    password_path = _private_file(secrets_dir, PASSWORD_FILE, secrets.token_urlsafe(24))
    return Credentials(user_path.read_text().strip(), password_path.read_text().strip(), password_path)


def keysmanager_token_file(secrets_dir: Path) -> Path:
    """The cluster's KeysManager bearer token (256 bits, mode 0600), generated once."""
    return _private_file(secrets_dir, KEYSMANAGER_TOKEN_FILE, secrets.token_urlsafe(32))

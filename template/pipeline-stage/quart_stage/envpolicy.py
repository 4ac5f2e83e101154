"""What a deploy's environment variables may be, and what a replica's environment is built from.

A replica is a Python process started by the gateway or a KeysManager: variables the interpreter, the
dynamic loader, libc or a library act on at start-up run code there (``PYTHONWARNINGS`` + ``BROWSER``
execute a shell command through ``webbrowser``; ``PYTHONSTARTUP``, ``PYTHONPATH``, ``LD_PRELOAD``,
``GCONV_PATH``, ``GLIBC_TUNABLES`` …), and variables the platform itself sets tell a replica where the
KeysManager's socket or another replica's secrets are. So a deploy's ``envVars`` follow one rule
(:func:`check_deploy_env`, a 400 naming ``envVars.<NAME>``):

- a name is ``[A-Za-z_][A-Za-z0-9_]*`` (at most 256 characters), a value holds no NUL and at most 64 KiB;
- names in :data:`DENIED_NAMES`, or starting with one of :data:`DENIED_PREFIXES`, are refused.

And a replica never inherits the operator's secrets: :func:`replica_base_env` drops from the host's
environment every variable that looks like a credential (:data:`PRIVATE_PREFIXES`, names holding
``TOKEN``, ``SECRET``, ``PASSWORD``, ``CREDENTIAL`` or ``PRIVATE_KEY``). Secrets a function is granted
arrive as files (``QUART_SECRETS_DIR``), nothing else. docs/gateway.md ("Environment of a deploy").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from quart_stage.errors import invalid

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
MAX_VALUE_BYTES = 64 * 1024

DENIED_PREFIXES: tuple[str, ...] = (
    "PYTHON",  # PYTHONSTARTUP, PYTHONPATH, PYTHONHOME, PYTHONWARNINGS, PYTHONBREAKPOINT, PYTHONINSPECT, …
    "LD_", "DYLD_",  # LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT
    "MALLOC_", "GLIBC_",  # libc tunables (GLIBC_TUNABLES: CVE-2023-4911)
    "PERL", "RUBY", "NODE_", "GIT_", "BASH_FUNC_",  # other interpreters a library may spawn
    "TORCHINDUCTOR_", "TORCH_EXTENSIONS", "TRITON_",  # compiled-code caches torch loads and runs
    "QUART_GATEWAY_", "QUART_SCHED_", "QUART_REGISTRY_", "KEYSMANAGER_",  # the platform's own settings
)
DENIED_NAMES: frozenset[str] = frozenset({
    "BROWSER", "EDITOR", "VISUAL", "PAGER", "SHELL",  # programs a library runs on our behalf
    "PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR",
    "ENV", "BASH_ENV", "IFS", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "CDPATH",
    "GCONV_PATH", "NLSPATH", "LOCPATH", "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "TZDIR",
    "SSLKEYLOGFILE", "OPENSSL_CONF", "OPENSSL_ENGINES", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "NO_PROXY",
    # set by the platform for each replica: a deploy must not point them elsewhere
    "QUART_LISTEN_FD", "QUART_KEYSMANAGER_SOCKET", "QUART_SECRETS_DIR", "QUART_STAGE_MOUNTS",
    "QUART_REPLICA_HOST", "QUART_BIND", "QUART_PRELOAD", "QUART_RUN_AS",
})
PRIVATE_PREFIXES: tuple[str, ...] = ("AWS_", "QUART_GATEWAY_", "QUART_REGISTRY_", "KEYSMANAGER_", "SSH_",
                                     "GOOGLE_APPLICATION", "AZURE_", "KUBECONFIG", "DOCKER_", "OPENFAAS_")
PRIVATE_WORDS: tuple[str, ...] = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE_KEY", "API_KEY")


def denied(name: str) -> str | None:
    """Why ``name`` may not be set by a deploy, or None when it may."""
    if not NAME_RE.match(name):
        return "is not a variable name ([A-Za-z_][A-Za-z0-9_]*, at most 256 characters)"
    if name in DENIED_NAMES or name.upper() in DENIED_NAMES:
        return "is set by the platform or makes the interpreter or a library run a program"
    upper = name.upper()
    for prefix in DENIED_PREFIXES:
        if upper.startswith(prefix):
            return f"starts with {prefix}: such variables load or run code in the replica's interpreter"
    return None


def check_deploy_env(env: Mapping[str, str], field: str = "envVars") -> dict[str, str]:
    """``env`` when every variable follows the rule above; else a 400 naming ``<field>.<NAME>``."""
    for name, value in env.items():
        why = denied(name)
        if why:
            raise invalid(f"{field}.{name}" if NAME_RE.match(name) else field,
                          f"environment variable {name!r} {why}; see docs/gateway.md (Environment of a deploy)")
        if "\x00" in value or len(value.encode("utf-8", "surrogatepass")) > MAX_VALUE_BYTES:
            raise invalid(f"{field}.{name}", f"the value of {name} holds a NUL byte or is over "
                                             f"{MAX_VALUE_BYTES} bytes")
    return dict(env)


def private(name: str) -> bool:
    """Whether a variable of the host's environment looks like a credential a replica must not inherit."""
    upper = name.upper()
    return upper.startswith(PRIVATE_PREFIXES) or any(word in upper for word in PRIVATE_WORDS)


def replica_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The host's environment without its credentials: what every replica starts from."""
    return {k: v for k, v in environ.items() if not private(k)}

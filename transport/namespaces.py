"""Namespaces as faas-cli names them: ``<name>.<namespace>`` in invocation paths, ``?namespace=`` and a
``namespace`` field on ``/system/*``. This gateway has one namespace; any other does not exist (404, as
``api-docs/spec.openapi.yml`` answers for a function that is not found)."""

from __future__ import annotations

from quart_stage.errors import QuartError


def split(name: str) -> tuple[str, str | None]:
    """``"fn.ns"`` → ``("fn", "ns")``; ``"fn"`` → ``("fn", None)`` (function names hold no dot: DNS-1123)."""
    base, dot, namespace = name.partition(".")
    return base, namespace if dot else None


def check(namespace: str | None, known: str) -> None:
    """Nothing when ``namespace`` is absent or ``known``; else a 404 :class:`QuartError` naming it."""
    if namespace and namespace != known:
        raise QuartError(404, f"namespace {namespace!r} does not exist; this gateway has {known!r}", "namespace")


def function_name(path_name: str, known: str) -> str:
    """The function (or pipeline) a ``/function/<path_name>`` call names; 404 for another namespace."""
    base, namespace = split(path_name)
    check(namespace, known)
    return base

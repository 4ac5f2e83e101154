"""aiohttp is used through its public interface only (issue 42, point 6): no private name of it is imported,
reached through a module, read off one of its objects, or touched by a class of ours built on one of its classes.

A private name is one with a leading underscore (not a dunder) that aiohttp defines: its modules' private
functions and classes, and the ``self._x`` attributes its classes set (``_server``, ``_bound_port``,
``_runner``...). Such names change between aiohttp releases without notice; the pin would have to hold them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from functools import cache
from pathlib import Path

import aiohttp
from support.paths import REPO

FOLDERS = ["template/pipeline-stage/quart_stage", "keysmanager", "transport", "kernel", "provider", "gateway-plugin",
           "tools", "tests"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def aiohttp_private_names() -> frozenset[str]:
    """Every private attribute name aiohttp's source sets on ``self`` or defines at a module's top level."""
    names: set[str] = set()
    for path in Path(aiohttp.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and _private(node.attr)):
                names.add(node.attr)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _private(node.name):
                names.add(node.name)
    return frozenset(names)


def _aiohttp_names(tree: ast.Module) -> dict[str, str]:
    """Local name → the aiohttp module or object it stands for (``web`` → ``aiohttp.web``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aiohttp":
                    names[(alias.asname or alias.name).split(".")[0]] = alias.name if alias.asname else "aiohttp"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aiohttp":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve(dotted: str) -> object | None:
    module, _, rest = dotted.partition(".")
    obj: object = importlib.import_module(module)
    for part in rest.split(".") if rest else []:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(f"{getattr(obj, '__name__', '')}.{part}")
            except ImportError:
                return None
    return obj


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _base_classes(node: ast.ClassDef, names: dict[str, str]) -> list[type]:
    """The aiohttp classes among ``node``'s bases."""
    found = []
    for base in node.bases:
        dotted = _dotted(base)
        if dotted is None or dotted.split(".")[0] not in names:
            continue
        head, _, rest = dotted.partition(".")
        obj = _resolve(names[head] + (f".{rest}" if rest else ""))
        if inspect.isclass(obj):
            found.append(obj)
    return found


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = _aiohttp_names(tree)
    if not names:
        return []
    private = aiohttp_private_names()
    where = path.relative_to(REPO)
    found = [f"{where}:{n.lineno}: imports {a.name} from {n.module}" for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "aiohttp"
             for a in n.names if _private(a.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value) or ""
            if dotted.split(".")[0] in names:
                found.append(f"{where}:{node.lineno}: {dotted}.{node.attr}")
            elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and node.attr in private:
                found.append(f"{where}:{node.lineno}: .{node.attr} (an aiohttp object's private attribute)")
        elif isinstance(node, ast.ClassDef):
            bases = _base_classes(node, names)
            theirs = {n for base in bases for cls in base.__mro__ if cls.__module__.startswith("aiohttp")
                      for n in [*vars(cls), *getattr(cls, "__slots__", ())] if _private(n)} | (private if bases else set())
            ours = {t.attr for sub in ast.walk(node) if isinstance(sub, ast.Assign | ast.AnnAssign)
                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                    if isinstance(t, ast.Attribute)}
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
                        and sub.attr in theirs and (sub.attr not in ours or sub.attr in private)):
                    found.append(f"{where}:{sub.lineno}: self.{sub.attr} in {node.name}, "
                                 f"a subclass of {', '.join(b.__name__ for b in bases)}")
    return found


def test_the_rule_finds_what_it_forbids() -> None:
    """The check is not vacuous: the uses removed in issue 42 are found."""
    sample = REPO / "tests" / "_aiohttp_private_sample.py"
    sample.write_text(
        "from aiohttp import web\n"
        "from aiohttp.web_urldispatcher import _default_expect_handler\n"
        "class Site(web.TCPSite):\n"
        "    async def start(self):\n"
        "        self._server = None\n"
        "        self._bound_port = 1\n"
        "def port(site):\n"
        "    return site._server.sockets[0]\n"
        "def ok(site):\n"
        "    return site.port\n")
    try:
        found = violations(sample)
    finally:
        sample.unlink()
    assert len(found) == 4, found
    assert any("_default_expect_handler" in f for f in found) and any("site._server" in f or "._server" in f
                                                                    for f in found)


def test_no_aiohttp_private_name_anywhere() -> None:
    assert {"_server", "_bound_port", "_default_expect_handler", "_runner"} <= aiohttp_private_names()
    found = [v for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py")) for v in violations(path)]
    assert not found, "aiohttp private names (use its public interface):\n" + "\n".join(found)

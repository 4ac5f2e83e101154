"""Every environment variable the product reads goes through the settings helper (issue 42, point 5):
``quart_stage.settings`` (``settings_from_env`` for a settings class, ``setting`` for a lone variable) is the one
module that reads the environment by name. Elsewhere the environment may be handed on whole (to a child process,
to ``settings_from_env``), or written (a library's variable set before it loads), never read by name:
no ``os.environ.get(...)``, ``os.environ[...]``, ``os.getenv(...)``, ``... in os.environ``."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO

PRODUCT = ["template/pipeline-stage", "keysmanager", "transport", "kernel", "provider", "gateway-plugin"]
HELPER = REPO / "template/pipeline-stage/quart_stage/settings.py"


def _is_environ(node: ast.expr, aliases: set[str]) -> bool:
    """``os.environ`` (or a name imported as ``from os import environ``)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
             and node.value.id == "os") or (isinstance(node, ast.Name) and node.id in aliases))


def reads(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
               for a in n.names if a.name == "environ"}
    getenv = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
              for a in n.names if a.name == "getenv"}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value, aliases):
                what = "os.environ.get"
            elif ((isinstance(func, ast.Attribute) and func.attr == "getenv" and isinstance(func.value, ast.Name)
                   and func.value.id == "os") or (isinstance(func, ast.Name) and func.id in getenv)):
                what = "os.getenv"
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and _is_environ(node.value, aliases)):
            what = "os.environ[...]"
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(_is_environ(c, aliases) for c in node.comparators):
            what = "in os.environ"
        if what:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {what}"))
    return [text for _, text in sorted(found)]


def test_the_rule_finds_each_kind_of_read(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom os import environ as E, getenv\n"
                      "a = os.environ.get('A')\nb = os.getenv('B')\nc = os.environ['C']\nd = 'D' in os.environ\n"
                      "e = E.get('E')\nf = getenv('F')\n"
                      "ok = {**os.environ}\nos.environ['G'] = '1'\nos.environ.setdefault('H', '1')\n")
    found = [line.split(": ", 1)[1] for line in reads(sample, tmp_path)]
    assert found == ["os.environ.get", "os.getenv", "os.environ[...]", "in os.environ", "os.environ.get",
                     "os.getenv"]


def test_the_product_reads_the_environment_only_through_the_settings_helper() -> None:
    found = [r for folder in PRODUCT for path in sorted((REPO / folder).rglob("*.py")) if path != HELPER
             for r in reads(path)]
    assert not found, ("environment read by name outside quart_stage.settings (use settings_from_env or "
                       "setting):\n" + "\n".join(found))

"""The shape of the house (docs/architecture.md): no import cycle between the project's modules, the
layering of the packages (the pure decision kernel and the shared HTTP transport below both the embedded
gateway and the plugin, which import neither each other nor upward), product modules free of benchmarks (a module
over 600 lines is a warning, not a failure: borders are drawn by responsibility, issue 42 item 4)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
from support.paths import REPO

ROOT = REPO
PACKAGES = {  # import name → folder (pyproject.toml, [tool.setuptools] package-dir)
    "quart_stage": ROOT / "template/pipeline-stage/quart_stage",
    "keysmanager": ROOT / "keysmanager",
    "quart_transport": ROOT / "transport",
    "quart_kernel": ROOT / "kernel",
    "quart_provider": ROOT / "provider",
    "gateway_plugin": ROOT / "gateway-plugin",
    "quart_tools": ROOT / "tools",
}
# What each package may import besides itself: strictly downward. The embedded gateway (quart_provider) and the
# plugin (gateway_plugin) are side by side: each imports the kernel and the transport, never the other.
BELOW = {
    "quart_stage": set(),
    "keysmanager": {"quart_stage"},
    "quart_transport": {"quart_stage", "keysmanager"},
    "quart_kernel": {"quart_stage"},
    "quart_provider": {"quart_stage", "keysmanager", "quart_transport", "quart_kernel"},
    "gateway_plugin": {"quart_stage", "keysmanager", "quart_transport", "quart_kernel"},
    "quart_tools": {"quart_stage", "keysmanager", "quart_transport", "quart_kernel", "quart_provider", "gateway_plugin"},
}
PRODUCT = ["quart_stage", "keysmanager", "quart_transport", "quart_kernel", "quart_provider", "gateway_plugin"]
# The kernel decides and never acts: none of these in it (time comes in as an argument or a clock it is given).
KERNEL_NEVER = {"aiohttp", "asyncio", "socket", "subprocess", "threading", "multiprocessing", "requests", "urllib",
                "http", "ssl", "selectors", "signal"}
WARN_LINES = 600  # a module this long is worth a look; the border is its responsibility, not a count


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``name`` imports, anywhere in the file (a function-level import is a dependency too)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            hit = resolve(target)
            if hit and hit != name:
                found.add(hit)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _top(module: str) -> str:
    return module.partition(".")[0]


def test_the_graph_is_built_from_real_imports() -> None:
    graph = _graph()
    assert "quart_kernel.replicaset" in graph["quart_tools.sim.control"]
    assert "gateway_plugin.controller" in graph["quart_tools.sim.control"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_the_layers_name_every_package_of_pyproject() -> None:
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {name: ROOT / folder for name, folder in dirs.items()} == PACKAGES
    assert set(BELOW) == set(PACKAGES)


def test_packages_import_only_lower_layers() -> None:
    wrong = [f"{src} imports {dst}" for src, targets in _graph().items() for dst in targets
             if _top(dst) != _top(src) and _top(dst) not in BELOW[_top(src)]]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", PRODUCT)
def test_product_modules_hold_no_benchmark_and_long_ones_are_named(package: str) -> None:
    long, benches = [], []
    for path in PACKAGES[package].rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > WARN_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        if "bench" in path.stem:
            benches.append(str(path.relative_to(ROOT)))
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines (split by responsibility if they hold two): {long}",
                      stacklevel=1)
    assert not benches, f"benchmarks belong in tools/bench: {benches}"


def _reached(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _top_level_imports(path: Path) -> set[str]:
    """Top-level module names ``path`` imports (absolute imports, anywhere in the file)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
    return found


def test_the_plugin_and_the_embedded_gateway_do_not_import_each_other() -> None:
    """Issue 26: the standalone plugin ships without the embedded gateway (quart_provider), and the embedded
    gateway knows the plugin only through the hooks it is given (quart_tools composes the two)."""
    for package, other in (("gateway_plugin", "quart_provider"), ("quart_provider", "gateway_plugin")):
        hits = [str(path.relative_to(ROOT)) for path in PACKAGES[package].rglob("*.py")
                if other in _top_level_imports(path)]
        assert not hits, f"{package} imports {other}: {hits}"
    graph = _graph()
    plugin = {dst for src, targets in graph.items() if _top(src) == "gateway_plugin" for dst in targets}
    assert {"quart_kernel.picking", "quart_kernel.admission", "quart_transport.upstream"} <= plugin  # real imports


def test_the_kernel_decides_and_never_acts() -> None:
    acting = {str(path.relative_to(ROOT)): sorted(_top_level_imports(path) & KERNEL_NEVER)
              for path in PACKAGES["quart_kernel"].rglob("*.py")}
    acting = {path: names for path, names in acting.items() if names}
    assert not acting, f"the kernel does I/O or concurrency: {acting}"


def test_the_policies_are_pure_decisions_over_the_plugin_snapshot() -> None:
    """The scaling policies stay in the plugin (docs/architecture.md says why) but are held to the kernel's rule:
    no sockets, event loop or processes (cv_online trains its model on one background thread, the only
    exception), and of the project only the snapshot, the policy settings, other policies, the kernel and the
    stage vocabulary."""
    allowed = {"gateway_plugin.snapshot", "gateway_plugin.config"}
    graph = _graph()
    for path in (PACKAGES["gateway_plugin"] / "policies").rglob("*.py"):
        never = KERNEL_NEVER - ({"threading"} if path.stem == "cv_online" else set())
        assert not _top_level_imports(path) & never, f"{path.relative_to(ROOT)} does I/O or concurrency"
    outside = {f"{src} imports {dst}" for src, targets in graph.items() if src.startswith("gateway_plugin.policies")
               for dst in targets if _top(dst) == "gateway_plugin" and not dst.startswith("gateway_plugin.policies")
               and dst not in allowed}
    assert not outside, sorted(outside)
    assert "gateway_plugin.snapshot" in graph["gateway_plugin.policies.quart"]


def test_the_plugin_image_ships_what_the_plugin_imports_and_not_the_embedded_gateway() -> None:
    """deploy/docker/plugin.Dockerfile copies exactly the packages the plugin (and the KeysManager, which runs from
    the same image) reach through their imports: no quart_provider, no quart_tools."""
    import re

    text = (ROOT / "deploy/docker/plugin.Dockerfile").read_text()
    folders = {str(folder.relative_to(ROOT)): name for name, folder in PACKAGES.items()}
    pairs = [(src, dst) for src, dst in re.findall(r"^COPY (\S+) \./lib/(\S+)$", text, re.M) if src in folders]
    assert all(dst == folders[src] for src, dst in pairs), f"each package goes under its import name: {pairs}"
    copied = {folders[src] for src, _ in pairs}
    graph = _graph()
    roots = [m for m in graph if _top(m) in ("gateway_plugin", "keysmanager")]
    needed = {_top(m) for m in _reached(graph, roots) | set(roots)}
    assert copied == needed, f"the plugin image copies {sorted(copied)}, the plugin needs {sorted(needed)}"
    assert not {"quart_provider", "quart_tools"} & copied


def _protocols(path: Path) -> list[ast.ClassDef]:
    """The ``class X(..., Protocol)`` definitions of a module."""
    tree = ast.parse(path.read_text(), str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)]


def test_the_plugin_ports_name_every_member_and_none_is_any() -> None:
    """Issue 40: the plugin reaches a platform through typed ports (gateway_plugin.ports), and every Protocol of
    the plugin (the ports, and the narrower interfaces beside the code that uses them) types its members: no
    ``Any`` in any of them. mypy (``make lint``, strict on the ports) checks that each implementation has them all."""
    ports = _protocols(PACKAGES["gateway_plugin"] / "ports.py")
    names = {cls.name for cls in ports}
    assert {"Replica", "ReplicaSource", "Platform", "DecisionNotes", "SessionWatch", "Scaler", "PluginHost"} <= names
    any_members = []
    for path in PACKAGES["gateway_plugin"].rglob("*.py"):
        for cls in _protocols(path):
            for node in ast.walk(cls):
                if (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute)
                                                                           and node.attr == "Any"):
                    any_members.append(f"{path.relative_to(ROOT)}:{node.lineno} ({cls.name})")
    assert not any_members, f"a port with an Any member: {any_members}"
    text = (PACKAGES["gateway_plugin"] / "ports.py").read_text()
    assert "Any" not in text.replace("Answer", ""), "gateway_plugin.ports names no Any at all"


# Every hasattr / getattr with a constant name in gateway-plugin/, by (module, attribute): what it probes, which is
# never a platform's (a platform's capability is a member of its port, declared, not probed).
PROBES_ALLOWED = {
    ("gateway-plugin/controller.py", "sessions_floor"): "a policy's own declaration (gateway_plugin.snapshot.Policy)",
    ("gateway-plugin/controller.py", "cv_model"): "whether a policy reads a CV model (only QUART's does)",
    ("gateway-plugin/policies/cv_online.py", "cv_model"): "whether a policy reads a CV model (only QUART's does)",
    ("gateway-plugin/generation/tokens.py", "chat_template"): "the tokenizer library's object (transformers)",
}


def test_the_plugin_probes_no_platform_capability() -> None:
    """Issue 40: no ``hasattr(x, "name")`` / ``getattr(x, "name", ...)`` on a platform in gateway-plugin/: what a
    platform may lack is a member of its port (gateway_plugin.ports) that says so. The probes left are listed
    above with what they probe; a new one fails here until it is a port member or listed with its reason."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in PACKAGES["gateway_plugin"].rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                found.setdefault((rel, node.args[1].value), []).append(node.lineno)
    unlisted = {f"{path}:{lines} {name!r}" for (path, name), lines in found.items()
                if (path, name) not in PROBES_ALLOWED}
    assert not unlisted, f"probes of a capability (declare it on a port in gateway_plugin.ports): {sorted(unlisted)}"
    stale = set(PROBES_ALLOWED) - set(found)
    assert not stale, f"listed probes that are gone (drop them from PROBES_ALLOWED): {sorted(stale)}"


TESTS = ROOT / "tests"
GROUPS = ("unit", "integration", "e2e")


def test_every_test_module_is_in_a_group_and_imports_no_other_test_module() -> None:
    """tests/unit (in process), tests/integration (processes and sockets on loopback), tests/e2e (the product as
    users run it); shared harnesses and fakes in tests/support, never in a test module (tests/README.md)."""
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test modules outside {GROUPS}: {loose}"
    modules = {p.stem for p in TESTS.rglob("test_*.py")}
    importing = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            importing += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.rpartition(".")[2] in modules or n.startswith("tests.")]
    assert not importing, f"import shared code from tests/support, not from a test module: {importing}"
    assert {p.parent.name for p in TESTS.rglob("test_*.py")} <= set(GROUPS)

"""The shape of the house (docs/architecture.md): no import cycle between the project's modules, the
layering of the packages, product modules under 500 lines and free of benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import REPO

ROOT = REPO
PACKAGES = {  # import name → folder (pyproject.toml, [tool.setuptools] package-dir)
    "quart_stage": ROOT / "template/pipeline-stage/quart_stage",
    "keysmanager": ROOT / "keysmanager",
    "quart_provider": ROOT / "provider",
    "gateway_plugin": ROOT / "gateway-plugin",
    "quart_tools": ROOT / "tools",
}
LAYERS = ["quart_stage", "keysmanager", "quart_provider", "gateway_plugin", "quart_tools"]  # imports go left
PRODUCT = ["quart_stage", "keysmanager", "quart_provider", "gateway_plugin"]  # what the images ship
MAX_LINES = 500


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
    assert "quart_provider.replicaset" in graph["quart_tools.sim.engine"]
    assert "gateway_plugin.controller" in graph["quart_tools.sim.engine"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_packages_import_only_lower_layers() -> None:
    wrong = [f"{src} imports {dst}" for src, targets in _graph().items() for dst in targets
             if LAYERS.index(_top(dst)) > LAYERS.index(_top(src))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", PRODUCT)
def test_product_modules_are_short_and_hold_no_benchmark(package: str) -> None:
    long, benches = [], []
    for path in PACKAGES[package].rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        if "bench" in path.stem:
            benches.append(str(path.relative_to(ROOT)))
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    assert not benches, f"benchmarks belong in tools/bench: {benches}"


# The embedded gateway itself (registry, reconciler, starter, its HTTP app, its supervisor): the standalone plugin
# runs beside a real OpenFaaS gateway and needs none of it (issue 26); what it may use of quart_provider is the
# pure decision kernel (admission, replicaset, balancer's pick, convergence, scheduling) and shared plumbing.
EMBEDDED_GATEWAY = ("gateway", "registry", "reconciler", "starting", "routes", "handlers_*", "supervisor", "store",
                    "adopt", "host_health", "keysmanager_host", "paraserve_start", "async_service", "system", "stack")


def _reached(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_the_plugin_does_not_import_the_embedded_gateway() -> None:
    import fnmatch

    graph = _graph()
    reached = _reached(graph, [m for m in graph if _top(m) == "gateway_plugin"])
    embedded = [m for m in sorted(reached) if _top(m) == "quart_provider"
                and any(fnmatch.fnmatch(m.partition(".")[2], pattern) for pattern in EMBEDDED_GATEWAY)]
    assert not embedded, f"the plugin reaches the embedded gateway: {embedded}"
    assert "quart_provider.replicaset" in reached  # the check sees the plugin's real imports


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

"""The house's imports run one way (docs/architecture.md, "Packages"): read from the source, every
import of a radixgen module (module level, under TYPE_CHECKING or inside a function alike) goes
to a lower layer or within its own package, no set of modules imports itself round in a circle,
and the channel between fronts and engines (ipc/) and the engine's plain data import neither
FastAPI nor torch when loaded."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "radixgen"

# a package may import its own modules and those of lower layers only
LAYERS = [
    {"json_lexer"},
    {"errors", "paths", "tool_formats", "templates", "reasoning", "staging", "host_memory"},
    {"config", "radix", "constraints", "kernels"},
    {"models"},
    {"engine"},
    {"ipc"},
    {"api", "cluster", "lang", "bench"},
    {"radixgen"},  # the package's face: Engine, SamplingParams, the DSL
    {"cli"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str], top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    known = set(paths)
    return {m: {t for t in _imports(p, m, known) if t in known and t != m} for m, p in paths.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "radixgen"


def test_every_package_is_in_a_layer() -> None:
    assert {_package(m) for m in _graph()} <= set(RANK), "a new package needs its place in LAYERS"


def test_packages_import_only_lower_layers() -> None:
    upward = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                    if _package(m) != _package(t) and RANK[_package(t)] >= RANK[_package(m)])
    assert not upward, "imports that run up or sideways:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other round in a circle: {circles}"


def test_the_channel_and_the_engines_plain_data_load_without_fastapi_or_torch() -> None:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    known = set(paths)
    light = [m for m in paths if m.startswith("radixgen.ipc")] + [
        "radixgen.engine.params", "radixgen.engine.output", "radixgen.engine.ngram"]
    heavy = {"torch", "fastapi", "numpy"}
    for module in light:
        loaded = {name.split(".")[0] for name in _imports(paths[module], module, known, top_level_only=True)}
        assert not loaded & heavy, f"{module} imports {loaded & heavy} when loaded"

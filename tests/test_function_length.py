"""Every function in the package reads in one screen: none is longer than 80 lines (a longer one
is split by what it does, as create_app was into its lifespan, error handlers and routes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "radixgen"
LIMIT = 80


def test_no_function_is_longer_than_the_limit() -> None:
    long: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these by what they do:\n" + "\n".join(long)

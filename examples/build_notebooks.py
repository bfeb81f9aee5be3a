"""Build the example notebooks from the plain scripts beside them.

The scripts are the source (``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell
whose lines are ``# `` comments), so each flow exists once and the notebooks never drift:

    python examples/build_notebooks.py          # rewrite the .ipynb files
    python examples/build_notebooks.py --check  # fail if a notebook is out of date (the tests do)
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

EXAMPLES = Path(__file__).resolve().parent
NOTEBOOKS = ("tool_calling", "order_status", "extraction")


def cells_of(script: str) -> list[nbformat.NotebookNode]:
    cells: list[nbformat.NotebookNode] = []
    kind, lines = None, []

    def flush() -> None:
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif kind == "code" and body:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in script.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook_of(name: str) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells_of((EXAMPLES / f"{name}.py").read_text())
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name}-{i}"  # stable ids keep the files byte-for-byte reproducible
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    return nbformat.writes(nb) + "\n"


def main(check: bool) -> int:
    stale = []
    for name in NOTEBOOKS:
        path, text = EXAMPLES / f"{name}.ipynb", notebook_of(name)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python examples/build_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))

"""The example notebooks run top to bottom on the bundled model (each asserts on its own
results), are stripped of outputs, and match the scripts they are built from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = ["tool_calling", "order_status", "extraction"]


def test_notebooks_are_built_from_the_scripts_and_carry_no_outputs() -> None:
    check = subprocess.run([sys.executable, str(EXAMPLES / "build_notebooks.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for name in NOTEBOOKS:
        nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), name


@pytest.mark.real_model
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name: str) -> None:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}})
    try:
        client.execute()
    except CellExecutionError as e:  # the failing cell and its traceback, not the whole notebook
        pytest.fail(f"{name}.ipynb: {e}")

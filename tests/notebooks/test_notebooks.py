"""Execute every `notebooks/*.ipynb` top to bottom and fail on any cell error.

The kernel is `python3` launched with this interpreter (`sys.executable`), i.e. the venv that
runs pytest; a check cell prepended to the (in-memory) copy asserts that. Executed notebooks
are written to pytest's tmp dir only, never into the repo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell

# Runs first in the kernel: same interpreter prefix as this pytest process (the venv).
KERNEL_CHECK = f"""\
import sys
assert sys.prefix == {sys.prefix!r}, f"kernel runs {{sys.executable}}, not the venv's python"
"""


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(KERNEL_CHECK))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",  # jupyter_client swaps the spec's "python" for sys.executable
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(path.parent)}},  # cwd = notebooks/
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, tmp_path / path.name)  # executed copy, for debugging failures

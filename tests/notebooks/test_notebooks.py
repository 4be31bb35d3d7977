"""The notebooks: jupytext percent-format `notebooks/NN_*.py` files are the source, each paired
with a committed `.ipynb` that carries its outputs (`make notebooks` writes both in step).

- `test_paired_ipynb_is_current` (fast, no kernel): every source has its `.ipynb`, whose cell
  types and sources equal the source's (outputs are not compared), and no `.ipynb` lacks a
  source.
- `test_notebook_executes` (marked `notebook`): runs each source top to bottom in a kernel
  and fails on any cell error. The kernel is `python3` launched with this interpreter
  (`sys.executable`), i.e. the venv that runs pytest; a check cell prepended to the
  in-memory copy asserts that. The executed copy goes to pytest's tmp dir, never the repo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext  # dev dependencies: missing, the tests must fail, not skip
import nbclient
import nbformat
import pytest
from helpers import ROOT

FOLDER = ROOT / "notebooks"
SOURCES = sorted(FOLDER.glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT = 300  # seconds per cell

# Runs first in the kernel: same interpreter prefix as this pytest process (the venv).
KERNEL_CHECK = f"""\
import sys
assert sys.prefix == {sys.prefix!r}, f"kernel runs {{sys.executable}}, not the venv's python"
"""


def cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def test_there_are_notebooks():
    assert len(SOURCES) >= 3, f"expected notebooks/NN_*.py sources in {FOLDER}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_paired_ipynb_is_current(source: Path) -> None:
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run `make notebooks`"
    want = cells(jupytext.read(source))
    got = cells(nbformat.read(paired, as_version=4))
    assert got == want, f"{paired.name} is stale (cell sources differ): run `make notebooks`"


def test_every_ipynb_has_a_source():
    orphans = [p.name for p in FOLDER.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a jupytext source: {orphans}"


@pytest.mark.notebook
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes(source: Path, tmp_path: Path) -> None:
    nb = jupytext.read(source)
    nb.cells.insert(0, nbformat.v4.new_code_cell(KERNEL_CHECK))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",  # jupyter_client swaps the spec's "python" for sys.executable
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(FOLDER)}},  # cwd = notebooks/
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, tmp_path / f"{source.stem}.ipynb")  # executed copy, for debugging

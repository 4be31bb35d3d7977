"""The shared machinery of the `make_0N.py` notebook generators: collect cells, write the
notebook with stable cell ids (regenerating gives an identical file) and no outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


class Notebook:
    """`nb.md(text)` / `nb.code(text)` append cells; `nb.write(path)` validates and writes."""

    def __init__(self) -> None:
        self.cells: list[tuple[str, str]] = []

    def md(self, text: str) -> None:
        self.cells.append(("markdown", text.strip("\n")))

    def code(self, text: str) -> None:
        self.cells.append(("code", text.strip("\n")))

    def build(self) -> nbformat.NotebookNode:
        nb = new_notebook(
            metadata={
                "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                "language_info": {"name": "python"},
            }
        )
        nb.cells = [
            new_markdown_cell(s) if kind == "markdown" else new_code_cell(s)
            for kind, s in self.cells
        ]
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{i:02d}"
        return nb

    def write(self, path: Path) -> None:
        nb = self.build()
        nbformat.validate(nb)
        nbformat.write(nb, path)
        print(f"wrote {path} ({len(nb.cells)} cells)")

"""Figures: the pictures the notebooks draw and `make figures` writes to `docs/figures/`.

Each module draws one kind of figure onto matplotlib axes from jaxpod's own data, so a
notebook cell and the PNG in the docs come from the same function:

    schedule    pipeline tick charts from the table the executor runs, and the measured
                memory and step time of each schedule against M
    memory      bytes per device stacked by kind (the planner) beside XLA's compiled total;
                also `jaxpod plan --chart`
    curves      training curves from run records (`metrics.jsonl`)
    rounding    float16 updates with round-to-nearest and stochastic rounding
    build       `python -m jaxpod.figures`: every figure, written deterministically

Drawing functions take axes and return nothing; they never call `plt.show()` or pick a
backend (the notebook shows figures inline, `build` uses Agg).
"""

from __future__ import annotations

from pathlib import Path


def save(fig, path: str | Path) -> Path:
    """Write `fig` as a PNG whose bytes depend only on the figure (no version or date)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path

"""`jaxpod plan --chart FILE`: the file checked before anything is planned, written after.

A name that is no image file, a directory, a place under a file or one that cannot be written
is refused in one line before the plan is made; a write that fails all the same (`/proc`, a
full disk) is one line too, naming the file and the operating system's reason.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxpod.errors import UserError
from jaxpod.run.logdir import nearest_existing
from jaxpod.run.record import reason

SUFFIXES = (".png", ".svg", ".pdf")


def check_chart_path(chart: str) -> None:
    """One-line `UserError` unless `chart` names an image file that can be written."""
    if not chart.lower().endswith(SUFFIXES):
        raise UserError(f"--chart {chart}: name a .png, .svg or .pdf file")
    path = Path(chart)
    if path.is_dir():
        raise UserError(f"--chart {chart} is a directory; name a file in it")
    existing = nearest_existing(path.parent)
    if not existing.is_dir():
        raise UserError(f"--chart {chart}: {existing} is a file, not a directory; name another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--chart {chart} cannot be written in {existing}; name another path")


def write_chart(result: dict, chart: str, name: str) -> Path:
    """Draw the plan `result` into `chart`; a write that fails is a one-line `UserError`."""
    from jaxpod.figures.memory import plan_chart

    try:
        return plan_chart(result, chart, name=name)
    except OSError as exc:
        why = reason(exc)
        raise UserError(f"--chart {chart} cannot be written ({why}); name another path") from None

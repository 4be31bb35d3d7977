"""`jaxpod runs`: the run directories under a folder, side by side.

A run directory is any directory holding a `config.yaml` (written by `jaxpod train` before
the first step). Everything shown is read from the run record: `config.yaml` (model, mesh,
steps), `metrics.jsonl` (the last training loss, the steps done, tokens/s) and `eval.json`
(the final validation loss; `metrics.jsonl`'s `val_loss` records if the run has not finished).
Nothing is unpickled; YAML is read without aliases (`jaxpod.config.safe_yaml`); bytes
that are not UTF-8 are replaced, only regular files are opened (a FIFO would block), and what
cannot be read at all shows as dashes. A long name is cut in the table; `--json` holds no
NaN or Infinity (JSON has none): a non-finite number is its string ("nan", "inf").
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

import yaml

from jaxpod.config.safe_yaml import safe_yaml
from jaxpod.data.store import is_url
from jaxpod.errors import UserError
from jaxpod.run.metrics import EVAL_FILE, METRICS_FILE

COLUMNS = ("name", "config", "mesh", "steps", "loss", "val_loss", "speed")
HEADERS = ("run", "config", "mesh RxPxT", "steps", "loss", "val loss", "speed")
UNITS = {"tokens": "tok/s", "images": "img/s"}  # what a step's throughput counts


CELL = 40  # the widest a text cell of the table gets
Reader = Callable[[str], str]  # a run's file name -> its text (OSError if it cannot be read)


def _text(path: Path) -> str:
    """The text of the regular file `path` (OSError for anything else: a FIFO never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, encoding="utf-8", errors="replace", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _records(read: Reader) -> list[dict]:
    """The parseable records of a `metrics.jsonl` (a line cut short by a kill is skipped)."""
    out = []
    try:
        lines = read(METRICS_FILE).splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def _read_yaml(read: Reader, name: str) -> dict:
    try:
        raw = safe_yaml(read(name))
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _read_json(read: Reader, name: str) -> dict:
    try:
        raw = json.loads(read(name))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _section(cfg: dict, name: str) -> dict:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


def _model_name(cfg: dict) -> str | None:
    """The model of a run's config; None where the config cannot be read (no guess)."""
    if not cfg:
        return None
    model = _section(cfg, "model")
    name = model.get("name", "gpt")
    if name == "efficientnet":
        return f"efficientnet-{model.get('variant', 'b0')}"
    if "layers" in model and "d_model" in model:
        return f"{name} {model['layers']}x{model['d_model']}"
    return name


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def runs_json(rows: list[dict]) -> str:
    """`rows` as JSON text, non-finite numbers as strings (JSON has no NaN)."""
    safe = lambda v: str(v) if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
    return json.dumps([{k: safe(v) for k, v in row.items()} for row in rows], indent=2)


def describe_run(run: Path, root: Path) -> dict:
    """`describe` of the run directory `run`, named by its path relative to `root`."""
    name = str(run.relative_to(root)) if run != root else run.name
    return describe(lambda file: _text(run / file), name, str(run))


def describe(read: Reader, name: str, path: str) -> dict:
    """One row: name, config, mesh, steps, losses, and the mean throughput `tokens_per_s`
    (token models) or `images_per_s` (classifiers), named by `unit`; `read(file)` is the text
    of one of the run's files (OSError if it cannot be read), `path` where the run is.

    Missing values are `None` (a run without metrics has only name, config, mesh, steps_total).
    """
    cfg = _read_yaml(read, "config.yaml")
    model, mesh, train = _section(cfg, "model"), _section(cfg, "mesh"), _section(cfg, "train")
    records = _records(read)
    losses = [r for r in records if _number(r.get("loss")) is not None]
    vals = [r for r in records if _number(r.get("val_loss")) is not None]
    unit = "images" if model.get("name") == "efficientnet" else "tokens"
    speeds = [_number(r.get(f"{unit}_per_s")) for r in losses]
    speeds = [s for s in speeds if s is not None]
    evals = _read_json(read, EVAL_FILE)
    val = _number(evals.get("final_val_loss"))
    if val is None and vals:
        val = float(vals[-1]["val_loss"])
    shape = [mesh.get(k) for k in ("replica", "pipeline", "tensor")]
    return {
        "name": name,
        "config": _model_name(cfg),
        "mesh": "x".join(str(s) for s in shape) if None not in shape else None,
        "steps_done": max((r["step"] for r in records), default=None),
        "steps_total": train.get("steps"),
        "loss": float(losses[-1]["loss"]) if losses else None,
        "val_loss": val,
        f"{unit}_per_s": sum(speeds) / len(speeds) if speeds else None,
        "unit": unit,
        "path": path,
    }


def find_runs(root: str | Path) -> list[Path]:
    """Directories under `root` (itself included) holding a `config.yaml`, oldest first by
    directory modification time."""
    root = Path(root).expanduser()
    if root.exists() and not root.is_dir():
        raise UserError(f"runs directory {root} is a file; pass a directory, e.g. jaxpod runs runs")
    if not root.is_dir():
        raise UserError(f"runs directory {root} does not exist; pass one, e.g. jaxpod runs runs")
    found = {p.parent for p in root.rglob("config.yaml") if "checkpoints" not in p.parts}
    return sorted(found, key=lambda p: (p.stat().st_mtime, str(p)))


def list_runs(root: str | Path = "runs") -> list[dict]:
    """`describe_run` of every run under `root` (a folder or a URL: `stored_runs`), oldest
    first."""
    if is_url(root):
        from jaxpod.inspect.stored_runs import list_stored_runs

        return list_stored_runs(root)
    return [describe_run(run, Path(root).expanduser()) for run in find_runs(root)]


def _cell(row: dict, column: str) -> str:
    if column == "steps":
        done, total = row["steps_done"], row["steps_total"]
        if done is None:
            return f"-/{total}" if total is not None else "-"
        return f"{done}/{total if total is not None else '-'}"
    if column == "speed":
        value = row.get(f"{row['unit']}_per_s")
        return "-" if value is None else f"{value:,.0f} {UNITS[row['unit']]}"
    value = row[column]
    if value is None:
        return "-"
    if column in ("loss", "val_loss"):
        return f"{value:.4f}"
    text = str(value)
    return text if len(text) <= CELL else f"{text[: CELL - 13]}...{text[-10:]}"


def format_runs(rows: list[dict]) -> str:
    """A plain-text table (one line per run, aligned columns); a note if there are none."""
    if not rows:
        return "no runs (no directory with a config.yaml)"
    table = [HEADERS, *[tuple(_cell(r, c) for c in COLUMNS) for r in rows]]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    numeric = {3, 4, 5, 6}  # right-aligned columns
    lines = [
        "  ".join(
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    return "\n".join(lines)

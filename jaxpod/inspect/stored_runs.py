"""`jaxpod runs URL`: the runs under a URL prefix (`gs://bucket/runs`, any fsspec filesystem),
the same rows as for a local folder (`jaxpod.inspect.runs`).

One listing of the prefix finds the run directories (a `config.yaml`, not inside
`checkpoints/`); of each run only `config.yaml`, `metrics.jsonl` and `eval.json` are read,
through fsspec: no checkpoint is downloaded, nothing is written, the URL is never a local
path. A store has no directory times, so runs are ordered by the newest modification time the
listing gives for the files directly in each run directory (a local folder's time is that of
its last file written), then by name. A prefix that holds nothing, a protocol no installed
fsspec filesystem serves, and a store that cannot be listed (credentials, network) are one
line each. jax-free.
"""

from __future__ import annotations

import datetime
from typing import Any

from jaxpod.data.store import TIME_FIELDS, filesystem, quiet
from jaxpod.errors import UserError
from jaxpod.inspect.runs import describe

CONFIG = "config.yaml"
EXAMPLE = "e.g. jaxpod runs gs://bucket/runs"


def _seconds(info: dict) -> float:
    """The modification time of a listing entry in seconds (0 if the store gives none)."""
    for key in TIME_FIELDS:
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value).timestamp()
            except ValueError:
                continue
    return 0.0


def _listing(fs: Any, root: str, url: str) -> dict[str, dict]:
    """Every file under `root` by its path relative to it; one-line `UserError` if there is
    none or the store cannot be listed."""
    try:
        if fs.isfile(root):
            raise UserError(f"runs directory {url} is a file; pass the prefix of runs, {EXAMPLE}")
        found = fs.find(root, detail=True)
    except UserError:
        raise
    except Exception as exc:  # any store's own error (auth, network, bucket): the user's setup
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"runs directory {url} cannot be listed ({why}); check the URL") from None
    files = {p[len(root) + 1 :]: i for p, i in found.items() if i.get("type", "file") == "file"}
    if not files:
        raise UserError(f"runs directory {url} does not exist (nothing there); pass one, {EXAMPLE}")
    return files


def _runs(files: dict[str, dict]) -> list[str]:
    """The run directories among `files` (relative, "" for the prefix itself), oldest first."""
    runs = {
        rel.rpartition("/")[0]
        for rel in files
        if rel.rpartition("/")[2] == CONFIG and "checkpoints" not in rel.split("/")
    }
    newest = dict.fromkeys(runs, 0.0)
    for rel, info in files.items():
        run = rel.rpartition("/")[0]
        if run in newest:
            newest[run] = max(newest[run], _seconds(info))
    return sorted(runs, key=lambda run: (newest[run], run))


def list_stored_runs(url: str) -> list[dict]:
    """`describe` of every run under the URL prefix `url`, oldest first (see the module)."""
    fs, root = filesystem("DIR", url)
    with quiet(fs):
        return _rows(fs, root.rstrip("/"), url.rstrip("/"))


def _rows(fs: Any, root: str, url: str) -> list[dict]:
    """The rows of the runs under `root`, the store's path of `url`."""
    rows = []
    for run in _runs(_listing(fs, root, url)):
        where = f"{root}/{run}" if run else root

        def read(file: str, where: str = where) -> str:
            return fs.cat_file(f"{where}/{file}").decode("utf-8", errors="replace")

        name = run or url.rpartition("/")[2]
        rows.append(describe(read, name, f"{url}/{run}" if run else url))
    return rows

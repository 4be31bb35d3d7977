"""Data behind a URL (`data.path=gs://bucket/corpus`, `data.tokenizer=s3://b/tokenizer.json`,
any fsspec filesystem): its files listed and read through fsspec, never as local paths.

`filesystem` resolves a URL to its fsspec filesystem, or refuses it in one line naming what to
install (gcsfs for gs://, s3fs for s3://). `stored_files` lists the files under a prefix
(hidden entries skipped, as for a local folder), each a `StoredFile` that carries its path
relative to the prefix and its `stamp`: its size and the markers the store changes when the
object is rewritten (etag, checksum, generation or modification time, from the listing), so
a cache keyed on the stamps of a corpus sees an edited object as a local folder sees an
edited file by its stat. `read_bytes` reads one whole object. `quiet(fs)` mutes the log of
the filesystem's package while a command whose errors are one line uses it. jax-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jaxpod.errors import DataError, UserError

URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")
# What a store changes when an object is rewritten (gcsfs, s3fs, adlfs, local, memory).
VERSION_FIELDS = ("etag", "ETag", "md5Hash", "crc32c", "generation", "checksum")
TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "created")


def is_url(path: object) -> bool:
    """True if `path` is a string naming a URL (`gs://...`, `s3://...`, `memory://...`)."""
    return isinstance(path, str) and URL.match(path) is not None


def filesystem(key: str, url: str) -> tuple[Any, str]:
    """`(fsspec filesystem, path in it)` of `url`; one-line `UserError` naming `key` if no
    installed fsspec implementation knows its protocol (e.g. gs:// without gcsfs)."""
    import fsspec

    protocol = URL.match(url).group(1)
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        why = str(exc).splitlines()[0] if str(exc) else "its package is not installed"
        raise UserError(f"{key}={url}: {protocol}:// needs a filesystem package ({why})") from None
    except ValueError:
        raise UserError(
            f"{key}={url}: no fsspec filesystem knows {protocol}://; use gs:// (gcsfs), s3:// "
            "(s3fs), another fsspec URL, or a local path"
        ) from None
    except Exception as exc:  # the filesystem's own check of its settings (e.g. dir:// unset)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"{key}={url}: its {protocol}:// filesystem cannot be opened ({why}); check the URL "
            "and that filesystem's settings"
        ) from None


@dataclass(frozen=True)
class StoredFile:
    """One object of a corpus under a URL: its filesystem, its path there, its path relative
    to the corpus's prefix (`/`-separated) and its `stamp` (see the module)."""

    fs: Any
    path: str
    rel: str
    stamp: str

    def open(self):
        """The object as a binary stream (read through the filesystem)."""
        return self.fs.open(self.path, "rb")


def stamp(info: dict) -> str:
    """The object's size and change markers, as one string (the whole entry if it has none)."""
    marks = {k: info[k] for k in (*VERSION_FIELDS, *TIME_FIELDS) if info.get(k) is not None}
    if not marks:
        marks = {k: v for k, v in info.items() if k != "name"}
    return json.dumps({"size": info.get("size"), **marks}, sort_keys=True, default=str)


def stored_files(url: str, what: str = "a directory of text files") -> list[StoredFile]:
    """The files under `url` (or the object `url` itself), hidden entries skipped, sorted by
    relative path; one-line `DataError` if nothing is there (`what`: what it should hold)."""
    fs, root = filesystem("data.path", url)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True) if fs.exists(root) else {}
    except OSError as exc:
        raise DataError(f"data.path={url} cannot be listed ({exc}); check the URL") from None
    if not found:
        raise DataError(f"data.path={url!r} does not exist; point data.path at {what}")
    files = []
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        rel = path.rsplit("/", 1)[-1] if path.rstrip("/") == root else path[len(root) + 1 :]
        if not any(part.startswith(".") for part in rel.split("/")):
            files.append(StoredFile(fs, path, rel, stamp(info)))
    return sorted(files, key=lambda f: f.rel.split("/"))


def read_bytes(key: str, url: str, what: str) -> bytes:
    """The whole object at `url`; one-line `DataError` naming `key` if it is not there
    (`what`: the kind of file `key` should name, e.g. 'a tokenizer.json')."""
    fs, path = filesystem(key, url)
    try:
        return fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{key}={url!r} is no file; name {what}") from None
    except OSError as exc:
        raise DataError(f"{key}={url!r} cannot be read ({exc}); name {what}") from None


@contextlib.contextmanager
def quiet(fs: Any) -> Iterator[None]:
    """Mute every logger of `fs`'s package (gcsfs logs each failed retry with a traceback)
    inside the block; the one-line error that follows says why."""
    log = logging.getLogger(type(fs).__module__.partition(".")[0])
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)

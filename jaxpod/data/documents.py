"""Text corpora as documents, and the held-out split by document.

A document is one file: a `.py` file of the Python standard library (`stdlib-code`) or a
UTF-8 file under `data.path` (`text-files`; hidden entries, binary and unreadable files
skipped), listed in sorted relative-path order: a local folder's `Path`s, or under a URL the
objects of an fsspec filesystem (`jaxpod.data.store.StoredFile`), read the same way. A
document is held out for validation when a hash of its text falls below `data.val_fraction`
of the hash range (`is_validation`): the split depends on each document's own text, never on
its position or on the other files, so no validation window shares a document with
training, and adding a file moves no other one across. Both the byte path
(`jaxpod.data.text`) and the token files (`jaxpod.data.tokens`) split this way.
Host-side only: standard library (fsspec for a URL), no jax.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from pathlib import Path

from jaxpod.data.store import StoredFile, is_url, stored_files
from jaxpod.errors import DataError

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SNIFF = 8192  # bytes looked at for a NUL (a binary file)


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document is held out: a hash of its text, below `val_fraction` of the range."""
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def stdlib_root() -> str:
    """The directory of this interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[Path]:
    """The `.py` files under `root` (third-party and cache folders skipped), sorted."""
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(paths, key=lambda p: p.relative_to(root).parts)


def text_files(path: str) -> list[Path] | list[StoredFile]:
    """The files under `path` (or `path` itself; a folder or a URL's prefix), hidden entries
    skipped, sorted; one-line `DataError` if it does not exist."""
    if is_url(path):
        return stored_files(path)
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path={path!r} does not exist; point data.path at a directory of text files"
        )
    if root.is_file():
        return [root]
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).parts)


def file_stamp(file: Path | StoredFile, root: Path | None) -> str:
    """What identifies a version of `file` in a cache key: its path relative to `root` (a
    `StoredFile` knows its own), its size and its modification time or store version."""
    if isinstance(file, StoredFile):
        return f"{file.rel}\0{file.stamp}"
    st = file.stat()
    return f"{file.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}"


def read_text(file: Path | StoredFile, limit: int | None = None) -> tuple[bytes, bool] | None:
    """The UTF-8 bytes of `file`, at most `limit` of them: `(data, cut)`, or None for a
    binary (a NUL in its first 8 KiB, or not UTF-8) or unreadable file. A character cut in two
    at the limit is no error."""
    head = _read_head(file, limit)
    if head is None:
        return None
    data, cut = head
    if b"\0" in data[:_SNIFF]:
        return None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError:
        return None
    return data, cut


def read_stdlib(file: Path, limit: int | None = None) -> tuple[bytes, bool] | None:
    """The bytes of a stdlib file, at most `limit` of them: `(data, cut)`, or None if it
    cannot be read (a few are not UTF-8: decoded with replacement characters)."""
    return _read_head(file, limit)


def _read_head(file: Path | StoredFile, limit: int | None) -> tuple[bytes, bool] | None:
    """`(the first limit bytes of file, whether it holds more)`, or None if it cannot be read."""
    try:
        with file.open() if isinstance(file, StoredFile) else open(file, "rb") as stream:
            data = stream.read(-1 if limit is None else limit + 1)
    except OSError:
        return None
    cut = limit is not None and len(data) > limit
    return (data[:limit] if cut else data), cut

"""A run's console lines, which never stop the run.

When the reader of stdout or stderr goes away (`jaxpod train ... | head`, a `tee` or log
collector that dies, a terminal that closes), the next write fails (EPIPE, EIO; a full disk
under a redirect: ENOSPC). `keep_going()` makes both streams carry on: the stream that failed is
pointed at /dev/null (its file descriptor, so every writer of it, tqdm, logging and Python's
final flush included, goes there too) and the run goes on, its record complete on disk.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


class _Sturdy:
    """A text stream whose failed writes send it to /dev/null instead of raising."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self.dropped = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._drop()

    def _drop(self) -> None:
        """Point the stream's descriptor at /dev/null; what it still buffers goes there."""
        self.dropped = True
        try:
            to_devnull(self._stream.fileno())
            self._stream.flush()
        except (OSError, ValueError):  # noqa: S110 - a closed stream: nothing left to lose
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def keep_going() -> None:
    """From now on a failed write to stdout or stderr never raises (module doc)."""
    if not isinstance(sys.stdout, _Sturdy):
        sys.stdout = _Sturdy(sys.stdout)
    if not isinstance(sys.stderr, _Sturdy):
        sys.stderr = _Sturdy(sys.stderr)


def to_devnull(fd: int) -> None:
    """Point file descriptor `fd` at /dev/null (a reader that went away: nothing more to say)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)

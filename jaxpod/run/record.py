"""The files of the run record, written only as jaxpod's own and every write checked.

Every file of the record (`metrics.jsonl`, TensorBoard events, `eval.json`, `config.yaml`,
`mapping.json`) is opened with `O_NOFOLLOW`: a symbolic link in its place is refused, never
written through. Whole files are written to a temporary name (created with `O_EXCL`) and
renamed into place; appended records are whole or absent (`AppendFile` cuts a failed append
back). A failed write is a `RecordWriteError`: one line naming the file and the operating
system's reason, a full disk called so, and no temporary file left behind. jax-free.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

from jaxpod.errors import UserError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_OPEN = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def reason(exc: OSError) -> str:
    """The operating system's reason for a failed write; a full disk (or quota) says so."""
    why = exc.strerror or str(exc) or type(exc).__name__
    return f"disk full: {why}" if exc.errno in _FULL else why


class RecordWriteError(UserError):
    """A file of the run record could not be written (`path`, `reason`)."""

    def __init__(self, path: str | Path, exc: OSError):
        self.path, self.reason, self.errno = Path(path), reason(exc), exc.errno
        self.full = exc.errno in _FULL
        if exc.errno == errno.ELOOP:
            self.reason = "it is a symbolic link, which jaxpod does not write through"
        super().__init__(f"cannot write {self.path} ({self.reason})")

    @property
    def fix(self) -> str:
        if self.full:
            return "free space on that disk"
        if self.errno == errno.EFBIG:
            return "raise the limit on the size of a file (ulimit -f)"
        return "make it writable (or remove what is in its place)"

    def stopped(self, step: int | None, saved: Path | None) -> UserError:
        """The error that ends a run this failure stopped at `step` (None: before its first
        step), its checkpoint `saved` there (None: none could be saved)."""
        at = "" if step is None else f" at step {step}"
        if saved is not None:
            return UserError(
                f"{self}{at}: training stopped and saved {saved} with the records the file "
                f"lacks; {self.fix}, then run the same command to resume"
            )
        return UserError(
            f"{self}{at}: training stopped, and no checkpoint of it could be saved; {self.fix}, "
            "then run the same command to resume from the newest checkpoint"
        )


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, _OPEN | flags, 0o644)
    except OSError as exc:
        raise RecordWriteError(path, exc) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place (a link at `path`
    is replaced, not followed); `RecordWriteError` if it fails, the temporary file removed."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover (or a link) of a killed run
    fd = _open(tmp, os.O_EXCL | os.O_TRUNC)
    try:
        try:
            _write_all(fd, data.encode() if isinstance(data, str) else data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RecordWriteError(path, exc) from None


class AppendFile:
    """A record file appended to in whole records: a record whose write fails is cut off
    again, so the file never ends in half a line (or half an event)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        check_regular(self.path)
        self._fd = _open(self.path, os.O_APPEND | os.O_NONBLOCK)  # a FIFO never blocks
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            check_regular(self.path)

    def append(self, data: bytes) -> None:
        """Append `data` whole, or raise `RecordWriteError` leaving the file as it was."""
        size = os.fstat(self._fd).st_size
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            self.cut(size)
            raise RecordWriteError(self.path, exc) from None

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def cut(self, size: int) -> None:
        """Cut the file back to `size` bytes (a record written only in part)."""
        try:
            os.ftruncate(self._fd, size)
        except OSError:  # noqa: S110 - the write's error is the one reported
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_regular(path: Path) -> None:
    """One-line `UserError` if something other than a regular file (a link, a FIFO, a
    directory) is at `path`, where the record keeps a file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise UserError(
            f"{path} is {what}, where jaxpod keeps its record; jaxpod writes only its own "
            "files: move it away or pick another train.logdir"
        )


def event_record(data: bytes) -> bytes:
    """`data` (a serialised `Event`) framed as a TFRecord: length, its CRC, data, its CRC."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    header = struct.pack("<Q", len(data))
    crc = lambda b: struct.pack("<I", masked_crc32c(b))  # noqa: E731
    return header + crc(header) + data + crc(data)

"""The run directory, claimed before a run writes to it: checked, created, locked.

`hold(logdir)` makes sure `train.logdir` can be a run directory (not a file, under no file,
writable, and jaxpod's: new, empty, or an earlier run's), creates it, and takes an exclusive
`fcntl.flock` on `<logdir>/.jaxpod.lock`, which records the holder's pid, host and start
time. A second run on the same directory is refused in one line naming the holder; the kernel
drops the lock of a process that dies, so a lock file left by a killed run is taken over (with
a note naming the dead holder). `release()` removes the lock file and, if the run left nothing
else, the directories `hold` created: a run refused before its first step leaves no trace.
jax-free: the CLI claims the directory before jax starts.

jaxpod writes only files it owns: an existing directory that holds other files and no jaxpod run
is refused, unless `foreign_ok` (`jaxpod train --logdir-exists ok`), and then only where none of
the record's names is taken; a link (or a FIFO) where the record keeps a file is refused.

With several processes only process 0 holds the lock (they share one directory). flock is
per host on most network filesystems: two hosts are not kept apart by it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from jaxpod.errors import UserError
from jaxpod.run.record import RecordWriteError, check_regular, reason

LOCK_FILE = ".jaxpod.lock"
CHECKPOINTS = "checkpoints"  # a run's checkpoints: <logdir>/checkpoints/<step>/
MAPPING = "mapping.json"  # written by every run before its first step: marks the directory
RECORD_FILES = ("metrics.jsonl", "eval.json", "config.yaml", MAPPING)  # at a run's top level
_held: dict[str, LogdirLock] = {}  # resolved path -> the lock this process holds


def _where(logdir: Path) -> str:
    return f"train.logdir={logdir}"


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where `mkdir -p` would start)."""
    while not path.exists():
        path = path.parent
    return path


def check_logdir(logdir: str | Path, foreign_ok: bool = False) -> None:
    """One-line `UserError` if `logdir` cannot be a run directory (before anything starts);
    `foreign_ok`: it may hold files that are not jaxpod's (none with a name the record uses)."""
    path = Path(logdir)
    try:
        _check_logdir(path, foreign_ok)
    except (OSError, RuntimeError) as exc:  # Python 3.11 raises RuntimeError for a link loop
        raise _unusable(path, exc) from None


def _unusable(path: Path, exc: OSError | RuntimeError) -> UserError:
    why = reason(exc) if isinstance(exc, OSError) else "a loop of symbolic links"
    return UserError(f"{_where(path)} cannot be used ({why}); pick another train.logdir")


def _check_logdir(path: Path, foreign_ok: bool) -> None:
    fix = "pick another train.logdir"
    if path.exists() and not path.is_dir():
        raise UserError(f"{_where(path)} is a file, not a directory; {fix}")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise UserError(f"{_where(path)}: {existing} is a file, not a directory; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise UserError(f"{_where(path)} {what} (permission denied); {fix}")
    saves = path / CHECKPOINTS
    if saves.exists() and not saves.is_dir():
        raise UserError(f"{_where(path)}: {saves} is a file, where checkpoints go; {fix}")
    if saves.is_dir() and not os.access(saves, os.W_OK | os.X_OK):
        raise UserError(
            f"{_where(path)}: {saves} is not writable (permission denied), so no checkpoint "
            f"could be saved; make it writable (chmod u+w {saves}) or {fix}"
        )
    resolved = path.resolve()
    for run in (resolved, *resolved.parents):  # in a run's checkpoints: they are not a run
        if run.name == CHECKPOINTS and (run.parent / "config.yaml").is_file():
            raise UserError(
                f"{_where(path)} is inside the checkpoints of the run in {run.parent} "
                f"(train.logdir={run.parent} resumes it); {fix}"
            )
    check_owned(path, foreign_ok)


def is_run(path: Path) -> bool:
    """True if `path` holds a jaxpod run: the `mapping.json` every run writes before its first
    step, or a checkpoint."""
    try:
        mapping = json.loads((path / MAPPING).read_text())
    except (OSError, ValueError):
        mapping = None
    if isinstance(mapping, dict) and {"mesh", "per_step"} <= mapping.keys():
        return True
    saves = path / CHECKPOINTS
    return saves.is_dir() and any(p.name.isdigit() for p in saves.iterdir())


def check_owned(path: Path, foreign_ok: bool = False) -> None:
    """One-line `UserError` unless every file jaxpod would write in `path` is its own to write:
    `path` is new, empty or a jaxpod run (else refused, unless `foreign_ok` and none of the
    record's names is taken), and no link or FIFO stands where the record keeps a file."""
    if not path.is_dir():
        return
    for name in (*RECORD_FILES, LOCK_FILE):
        check_regular(path / name)
    others = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)
    if not others or is_run(path):
        return
    if not foreign_ok:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(
            f"{_where(path)} holds files that are not a jaxpod run ({shown}); pick a new or "
            "empty directory, or pass --logdir-exists ok to add the run among them (jaxpod "
            "never deletes or changes a file it did not write)"
        )
    taken = [n for n in (*RECORD_FILES, CHECKPOINTS) if os.path.lexists(path / n)]
    if taken:
        raise UserError(
            f"{_where(path)} already holds {taken[0]}, which jaxpod did not write and would "
            "replace; move it away or pick another train.logdir"
        )


class LogdirLock:
    """This process's claim on a run directory (see `hold`)."""

    def __init__(self, logdir: Path, fd: int, created: Path | None):
        self.logdir, self._fd, self._created = logdir, fd, created

    def release(self) -> None:
        """Drop the lock (and the directories `hold` created, if the run left them empty)."""
        if self._fd is None:
            return
        _held.pop(str(self.logdir.resolve()), None)
        (self.logdir / LOCK_FILE).unlink(missing_ok=True)  # still locked: nobody re-reads it
        os.close(self._fd)
        self._fd = None
        path = self.logdir
        while self._created is not None and path.is_relative_to(self._created):
            try:
                path.rmdir()  # only if empty
            except OSError:
                break
            path = path.parent

    def __enter__(self) -> LogdirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    started = holder.get("started")
    since = f", since {started}" if isinstance(started, str) else ""
    return f"pid {pid} on host {host}{since}"


def _lock(path: Path) -> int:
    """An fd holding the flock of `path`; one-line `UserError` if another process holds it."""
    while True:
        check_regular(path)  # never a link followed, nor a FIFO opened
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(
                f"{_where(path.parent)}: cannot create {path.name} ({reason(exc)}); "
                "pick another train.logdir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"{_where(path.parent)} is in use by another jaxpod run ({_describe(holder)}); "
                "wait for it to finish or stop it, or pick another train.logdir"
            ) from None
        try:  # the holder may have removed the file between our open and flock: retry
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def hold(logdir: str | Path, foreign_ok: bool = False) -> LogdirLock:
    """Check, create and lock `logdir` for this process (again: the same lock); `foreign_ok`:
    see `check_logdir`."""
    path = Path(logdir)
    try:
        key = str(path.resolve())
    except (OSError, RuntimeError) as exc:
        raise _unusable(path, exc) from None
    if key in _held:
        return _held[key]
    check_logdir(path, foreign_ok)
    created = None
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        created = parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"{_where(path)} cannot be created ({exc.strerror}); pick another train.logdir"
        ) from None
    fd = _lock(path / LOCK_FILE)
    stale = _holder(fd)
    if stale.get("pid") is not None:
        print(
            f"jaxpod: note: {_where(path)} was locked by a run that is no longer running "
            f"({_describe(stale)}); taking it over",
            file=sys.stderr,
            flush=True,
        )
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    me["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    lock = _held[key] = LogdirLock(path, fd, created)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    except OSError as exc:
        lock.release()
        failed = RecordWriteError(path / LOCK_FILE, exc)
        raise UserError(f"{failed}; {failed.fix} or pick another train.logdir") from None
    return lock


def release_all() -> None:
    """Release every lock this process holds (the CLI, when a run ends in an error)."""
    for lock in list(_held.values()):
        lock.release()

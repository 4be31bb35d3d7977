"""User-facing errors: one line naming the field and the fix.

The CLI prints them without a traceback (`one_line`: never an unbounded value) and exits 2;
`exit_now` leaves promptly even when library threads (orbax's writers) would keep the
interpreter alive.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn, TextIO


class UserError(Exception):
    """Base class for mistakes in user input (config, data paths, mesh). Exit code 2 in the CLI."""


class ConfigError(UserError):
    """A config file or KEY=VALUE override that does not parse or does not validate."""


class DataError(UserError):
    """A dataset that cannot be read (missing path, no text, too small for the batch)."""


def one_line(text: object, limit: int = 600) -> str:
    """`text` on one line; words over 80 characters (pasted values; paths over 300) and the
    whole line cut."""

    def cut(w: str) -> str:
        longest = 300 if "/" in w else 80
        return w if len(w) <= longest else f"{w[: longest - 20]}...{w[-12:]}"

    words = [cut(w) for w in str(text).split()]
    line = " ".join(words)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def exit_now(code: int, wait: float = 5.0) -> NoReturn:
    """Exit with `code`: normally, unless non-daemon threads (a library's background writers)
    are still alive after `wait` seconds; then without waiting for them (`os._exit`, after
    flushing stdout and stderr), so a failed run never holds its machine."""
    deadline = time.monotonic() + wait
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            # the base class's join: orbax's threads override it to raise on a timeout
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    alive = [
        t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon
    ]
    if not alive:
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr, user_stderr()):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# The CLI exits right after a user error. Some failures (a checkpoint whose arrays cannot be
# read) leave library threads behind that print tracebacks for seconds afterwards; in the CLI
# those would bury the one-line error, so such a failure keeps the process muted until exit.
_cli = {"exits_on_error": False, "stream": None}


def exit_on_user_error() -> None:
    """Called once by the CLI: it exits after printing a `UserError`, so `Muted.keep` may
    leave the process muted for good."""
    _cli["exits_on_error"] = True


def user_stderr() -> TextIO:
    """Where the CLI prints a user error: the real stderr, also after `Muted.keep`."""
    return _cli["stream"] or sys.stderr


class Muted:
    """`with Muted() as mute:` sends fd 2 (and unraisable-exception reports) to /dev/null.

    Inside, `mute.keep()` asks to stay muted after the block: granted (returns True) only in
    the CLI, which keeps the real stream for `user_stderr()` and exits next.
    """

    def __enter__(self) -> Muted:
        sys.stderr.flush()
        self._saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        self._hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
        self._kept = False
        return self

    def keep(self) -> bool:
        if _cli["exits_on_error"]:
            self._kept = True
        return self._kept

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        if self._kept:
            _cli["stream"] = os.fdopen(self._saved, "w", buffering=1)
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives until the process exits
            return
        os.dup2(self._saved, 2)
        os.close(self._saved)
        sys.unraisablehook = self._hook

"""Ctrl-C and SIGTERM during training: finish the step, save it, then stop (exit 130 / 143).

Inside `with StopRequests() as stop:` the first SIGINT or SIGTERM only sets `stop.requested`
while `stop.armed` is true (the step loop and the final save): the loop then saves a
checkpoint of the step it is on, waits for it to commit, writes every record, and raises
`Interrupted`. Outside the armed part (start-up, compiling) and on a second signal, the signal
interrupts at once (`Interrupted` is raised where the program is); an in-flight save is then
abandoned, which orbax makes atomic (an uncommitted checkpoint is never listed). Handlers are
only installed in the main thread of a single-process run: with several processes a signal
reaches one of them, which cannot save alone.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; the CLI exits with 128 + `signum` and prints `message`."""

    def __init__(self, signum: int = signal.SIGINT, message: str = "interrupted"):
        super().__init__(message)
        self.signum, self.message = signum, message


class StopRequests:
    """Turns SIGINT/SIGTERM into a request to stop after the current step (see module doc)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.armed = False
        self.requested: int | None = None  # the signal received while armed
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if not self.armed or self.requested is not None:
            raise Interrupted(signum)
        self.requested = signum
        print(
            f"jaxpod: {signal.Signals(signum).name}: saving a checkpoint of this step, then "
            "stopping (again to stop at once, without it)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> StopRequests:
        if self.enabled:
            for signum in SIGNALS:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old = {}

"""Ctrl-C, SIGTERM and SIGHUP during training: finish the step, save it, then stop (exit 130,
143, 129). SIGHUP is what a closing terminal or ssh session sends: handled like SIGTERM (its
console is gone too, which `jaxpod.run.console` makes harmless).

Inside `with StopRequests() as stop:` the first SIGINT, SIGTERM or SIGHUP only sets `stop.requested`
while `stop.armed` is true (the step loop and the final save): the loop then saves a
checkpoint of the step it is on, waits for it to commit, writes every record, and raises
`Interrupted`. Outside the armed part (start-up, compiling) and on a second signal, the signal
interrupts at once (`Interrupted` is raised where the program is); an in-flight save is then
abandoned, which orbax makes atomic (an uncommitted checkpoint is never listed). Handlers are
only installed in the main thread of a single-process run: with several processes a signal
reaches one of them, which cannot save alone.

An exception raised while Python runs a callback that ignores exceptions (jax's garbage
collection hook, during the first compile) is lost (and not printed). So every signal that
interrupts at once is also recorded, and arming the loop (`StopRequests.arm`) raises a lost
one: a run interrupted during start-up never trains on. `interrupt_at_once` installs that
handling from the CLI's start (SIGTERM included), before a run's `StopRequests`.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; the CLI exits with 128 + `signum` and prints `message`."""

    def __init__(self, signum: int = signal.SIGINT, message: str = "interrupted"):
        super().__init__(message)
        self.signum, self.message = signum, message


_raised: list[int] = []  # signals whose `Interrupted` was raised, and may have been lost


def _interrupt_now(signum: int, frame) -> None:
    _raised.append(signum)
    raise Interrupted(signum)


def interrupt_at_once() -> None:
    """SIGINT, SIGTERM and SIGHUP raise `Interrupted` where the program is, recorded (module
    doc); the main thread only. The CLI calls it before a run starts. An `Interrupted` that
    Python drops is not printed (`_quiet_when_lost`): it is recorded, and a second Ctrl-C
    while the run stops printed a traceback."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _interrupt_now)
        if sys.unraisablehook is not _quiet_when_lost:
            _lost_hook.append(sys.unraisablehook)
            sys.unraisablehook = _quiet_when_lost


_lost_hook: list = []  # the hook `_quiet_when_lost` hands every other exception to


def _quiet_when_lost(unraisable) -> None:
    """`sys.unraisablehook`: an `Interrupted` raised in a callback that ignores exceptions is
    dropped quietly (`_raised` holds it); anything else goes to the hook it replaced."""
    if not isinstance(unraisable.exc_value, Interrupted):
        (_lost_hook or [sys.__unraisablehook__])[-1](unraisable)


def forget_interrupts() -> None:
    """An `Interrupted` reached its handler: nothing was lost."""
    _raised.clear()


class StopRequests:
    """Turns SIGINT/SIGTERM/SIGHUP into a request to stop after the current step (module doc)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.armed = False
        self.requested: int | None = None  # the signal received while armed
        self.failure = None  # a failed write of the run record (`RecordWriteError`): stop too
        self._old: dict[int, object] = {}

    @property
    def ends_run(self) -> bool:
        """A signal or a failed write of the record: save this step and stop."""
        return self.requested is not None or self.failure is not None

    def _handle(self, signum: int, frame) -> None:
        if not self.armed or self.requested is not None:
            _interrupt_now(signum, frame)
        self.requested = signum
        print(
            f"jaxpod: {signal.Signals(signum).name}: saving a checkpoint of this step, then "
            "stopping (again to stop at once, without it)",
            file=sys.stderr,
            flush=True,
        )

    def arm(self) -> None:
        """From now on a first signal is a request to stop after the step; an `Interrupted`
        raised before and lost (module doc) is raised again here."""
        if _raised:
            raise Interrupted(_raised[-1])
        self.armed = True

    def __enter__(self) -> StopRequests:
        if self.enabled:
            for signum in SIGNALS:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            forget_interrupts()
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old = {}

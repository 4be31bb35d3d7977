"""Progress while a run waits: the phase it is in with its elapsed time, and the time a run of
steps has taken and has left.

`Phase` wraps work that prints nothing for a long time (building a pod-size state, lowering,
XLA compiling: seconds on a laptop, minutes for a full-size preset). It writes the phase's name
when it begins, then its elapsed time: on a terminal one line rewritten in place every second
and cleared at the end (the caller prints the outcome); elsewhere (SLURM, nohup, a pipe, where
nothing is rewritten) a new line every `every` seconds, so a log shows the process alive and
where its time goes. `elapsed_and_eta` is the tail of the step lines written without a terminal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TextIO

TERMINAL_EVERY = 1.0  # seconds between rewrites of the line on a terminal
LOG_EVERY = 15.0  # seconds between new lines elsewhere


def duration(seconds: float) -> str:
    """`7 s`, `2 m 05 s`, `3 h 04 m`: a duration to read at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} m {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} m"


def elapsed_and_eta(elapsed: float, done: int, left: int) -> str:
    """`elapsed 1 m 10 s  eta 3 m 30 s`: `done` steps took `elapsed` seconds, `left` remain
    at the same pace (evaluations and checkpoints included, as they recur)."""
    eta = elapsed / done * left if done > 0 else None
    return f"elapsed {duration(elapsed)}  eta " + ("?" if eta is None else duration(eta))


def beat(wait: Callable[[float], bool], every: float, tick: Callable[[], None]) -> int:
    """Call `tick` every `every` seconds until `wait(every)` says the phase ended (an
    `Event.wait`: True once set). Returns how many ticks there were."""
    ticks = 0
    while not wait(every):
        tick()
        ticks += 1
    return ticks


class Phase:
    """`with Phase("compiling the train step", sys.stderr): ...`: the phase and its elapsed
    seconds on `stream` while the block runs (nothing if `stream` is None). `prefix` starts
    every line written (`jaxpod: ` on stderr); `clock` is the time source."""

    def __init__(
        self,
        text: str,
        stream: TextIO | None,
        *,
        prefix: str = "",
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.text, self.stream, self.prefix, self.clock = text, stream, prefix, clock
        self.tty = stream is not None and stream.isatty()
        self.every = every if every is not None else TERMINAL_EVERY if self.tty else LOG_EVERY
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self.start = 0.0

    def line(self) -> str:
        """The phase and, once a second has passed, its elapsed time."""
        elapsed = self.clock() - self.start
        shown = f" {duration(elapsed)}" if elapsed >= 1 else ""
        return f"{self.prefix}{self.text} ...{shown}"

    def tick(self) -> None:
        self._write(self.line())

    def _write(self, text: str) -> None:
        assert self.stream is not None
        if self.tty:  # one line, rewritten in place
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> Phase:
        if self.stream is None:
            return self
        self.start = self.clock()
        self.tick()
        args = (self._ended.wait, self.every, self.tick)
        self._thread = threading.Thread(target=beat, args=args, name="phase", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._ended.set()
        self._thread.join()
        if self.tty:  # the caller says how it ended
            self.stream.write("\r\033[K")
            self.stream.flush()

"""Progress while a run waits (`jaxpod.run.progress`) and the step lines' elapsed time and ETA
(`jaxpod.run.steplog`), on a clock the test sets: nothing here waits or reads the time."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import make_tiny_cfg

from jaxpod.run.progress import Phase, beat, duration, elapsed_and_eta
from jaxpod.run.steplog import StepLog

NEVER = 1e9  # a beat interval no test reaches: the phase's thread only waits for its end


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (7.4, "7 s"), (59.6, "1 m 00 s"), (125, "2 m 05 s"), (3 * 3600 + 245, "3 h 04 m")],
)
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_elapsed_and_eta_at_the_pace_so_far():
    assert elapsed_and_eta(70, done=10, left=30) == "elapsed 1 m 10 s  eta 3 m 30 s"
    assert elapsed_and_eta(70, done=40, left=0) == "elapsed 1 m 10 s  eta 0 s"
    assert elapsed_and_eta(0, done=0, left=5) == "elapsed 0 s  eta ?"


def test_beat_ticks_until_the_phase_ends():
    answers = iter([False, False, False, True])  # `Event.wait`: True once the phase ended
    waits, ticks = [], []

    def wait(every):
        waits.append(every)
        return next(answers)

    assert beat(wait, 15.0, lambda: ticks.append(1)) == 3
    assert waits == [15.0] * 4 and len(ticks) == 3


def test_a_phase_in_a_log_adds_a_line_per_beat():
    """No terminal (SLURM, nohup, a pipe): the name at once, then a line with the elapsed
    time at each beat; nothing at the end (the caller says how it went)."""
    clock, out = Clock(), io.StringIO()
    phase = Phase("compiling it with XLA:CPU", out, prefix="jaxpod: ", every=NEVER, clock=clock)
    assert phase.every == NEVER and not phase.tty
    with phase:
        clock.now += 15.2
        phase.tick()
        clock.now += 110
        phase.tick()
    assert out.getvalue().splitlines() == [
        "jaxpod: compiling it with XLA:CPU ...",
        "jaxpod: compiling it with XLA:CPU ... 15 s",
        "jaxpod: compiling it with XLA:CPU ... 2 m 05 s",
    ]
    assert Phase("x", io.StringIO()).every == 15.0  # a new line every 15 s by default


def test_a_phase_on_a_terminal_rewrites_one_line_and_clears_it():
    clock, out = Clock(), Terminal()
    phase = Phase("compiling      the train step", out, every=NEVER, clock=clock)
    assert phase.tty and Phase("x", Terminal()).every == 1.0
    with phase:
        clock.now += 3
        phase.tick()
    clear = "\r\033[K"
    assert out.getvalue() == (
        f"{clear}compiling      the train step ...{clear}compiling      the train step ... 3 s"
        f"{clear}"
    )


def test_a_silent_phase_writes_nothing_and_starts_no_thread():
    with Phase("building", None) as phase:
        pass
    assert phase._thread is None


def test_step_lines_without_a_terminal_carry_elapsed_and_eta():
    cfg = make_tiny_cfg("train.steps=10", "train.log_every=5")
    task = SimpleNamespace(unit="tokens", per_step=1000)
    writer = SimpleNamespace(records=[], write=lambda r: writer.records.append(r))
    bar = SimpleNamespace(disable=True, set_postfix=lambda **kw: None)
    lines: list[str] = []
    clock = Clock()
    steplog = StepLog(cfg, task, writer, bar, lines.append, 0, ckpt=None, clock=clock)
    metrics = {"loss": np.float32(2.0), "lr": np.float32(1e-3), "param_norm": np.float32(1)}
    for step in range(1, 11):
        clock.now = 100.0 + 3 * step  # step N-1 is read when step N is pushed
        steplog.push(step, metrics)
    clock.now = 133.0
    steplog.flush()
    assert [line.split("tokens/s")[1] for line in lines] == [
        "  elapsed 18 s  eta 18 s",  # step 5, read at 18 s: 5 steps to go at 3.6 s a step
        "  elapsed 33 s  eta 0 s",
    ]
    assert lines[0].startswith("step      5/10  loss 2.0000  lr 1.00e-03  278 tokens/s")
    assert [r["step"] for r in writer.records] == [5, 10]

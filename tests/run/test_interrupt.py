"""Signals during a run (`jaxpod.run.interrupt`), in process: an interrupt lost in a callback
that ignores exceptions is not printed, and is raised again when the loop is armed (real runs:
tests/cli/test_interrupt_cli.py)."""

from __future__ import annotations

import signal

import pytest

from jaxpod.run import interrupt
from jaxpod.run.interrupt import Interrupted, StopRequests


@pytest.fixture(autouse=True)
def _nothing_raised_before():
    interrupt.forget_interrupts()
    yield
    interrupt.forget_interrupts()


def test_an_interrupt_lost_before_the_loop_is_raised_when_it_arms():
    """As in jax's garbage-collection hook during the first compile: the handler's exception
    is printed and dropped, and the run would train on."""
    try:
        interrupt._interrupt_now(signal.SIGTERM, None)
    except Interrupted:
        pass  # lost
    with pytest.raises(Interrupted) as raised, StopRequests(enabled=False) as stop:
        stop.arm()
    assert raised.value.signum == signal.SIGTERM and not stop.armed
    StopRequests(enabled=False).arm()  # it reached its handler (`__exit__`): forgotten


def test_armed_a_first_signal_is_a_request_a_second_interrupts():
    with StopRequests(enabled=False) as stop:
        stop.arm()
        stop._handle(signal.SIGINT, None)
        assert stop.requested == signal.SIGINT
        with pytest.raises(Interrupted):
            stop._handle(signal.SIGINT, None)


def test_unarmed_a_signal_interrupts_at_once():
    with pytest.raises(Interrupted) as raised, StopRequests(enabled=False) as stop:
        stop._handle(signal.SIGINT, None)
    assert raised.value.signum == signal.SIGINT and stop.requested is None


@pytest.mark.parametrize("step, resume", [(3, True), (4, False)], ids=["mid-run", "last-step"])
def test_the_interrupted_line_says_whether_anything_is_left_to_resume(tmp_path, step, resume):
    """A signal during the final save saves the last step: the run is complete, not resumable."""
    from types import SimpleNamespace as Fake

    from helpers import make_tiny_cfg

    from jaxpod.run.loop import _close_record

    cfg = make_tiny_cfg("train.steps=4", f"train.logdir={tmp_path}")
    stop = Fake(requested=signal.SIGINT, failure=None)
    ckpt = Fake(shown=tmp_path / "checkpoints", logdir=tmp_path)
    profiler = Fake(trace=None)
    with pytest.raises(Interrupted) as caught:
        _close_record(cfg, None, Fake(step=step), ckpt, profiler, stop, print, main=False)
    assert caught.value.message.startswith(
        f"interrupted at step {step}:" if resume else f"interrupted at the last step, {step}:"
    )
    assert caught.value.message.endswith(
        "run the same command to resume" if resume else "the run is complete"
    )


def test_an_interrupt_python_drops_is_recorded_and_not_printed(capfd, monkeypatch):
    """A second Ctrl-C while a run stops landed in a weak reference's callback, where Python
    prints the exception and drops it: a traceback above the run's last line."""
    import sys
    import weakref

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # restored after
    old = {signum: signal.getsignal(signum) for signum in interrupt.SIGNALS}
    try:
        interrupt.interrupt_at_once()

        class Held:
            pass

        held = Held()
        ref = weakref.ref(held, lambda _: signal.raise_signal(signal.SIGINT))
        del held  # the callback runs, the handler raises inside it, Python drops that
        assert ref() is None
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
    assert interrupt._raised == [signal.SIGINT]  # recorded: `arm` raises it again
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err

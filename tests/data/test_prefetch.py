"""The Prefetcher (`jaxpod.data.prefetch`): order, errors, early close, bounded depth."""

import threading
import time

import pytest

from jaxpod.data.prefetch import Prefetcher


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetcher_order(depth):
    with Prefetcher(lambda i: i * i, 2, 9, depth) as p:
        assert list(p) == [i * i for i in range(2, 9)]
    assert list(Prefetcher(str, 5, 5, depth)) == []


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_reraises_producer_exception(depth):
    def make(i):
        if i == 3:
            raise Boom(f"item {i}")
        return i

    got = []
    with pytest.raises(Boom, match="item 3"):
        with Prefetcher(make, 0, 10, depth) as p:
            for item in p:
                got.append(item)
    assert got == [0, 1, 2]


def _run_with_timeout(fn, seconds=10.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not finish in time."""
    done = threading.Event()
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    assert done.wait(seconds), f"did not finish within {seconds}s (deadlock?)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetcher_early_close_does_not_hang(depth):
    calls = []

    def make(i):
        calls.append(i)
        time.sleep(0.01)
        return i

    def consume():
        p = Prefetcher(make, 0, 1000, depth)
        for item in p:
            if item == 2:
                break
        p.close()
        assert p._thread is not None and not p._thread.is_alive()
        assert len(calls) <= 3 + depth + 1
        assert list(p) == []  # closed: iteration ends
        p.close()  # idempotent
        with Prefetcher(make, 0, 1000, depth) as q:  # context manager, never iterated
            time.sleep(0.05)
        assert not q._thread.is_alive()

    _run_with_timeout(consume)


def test_prefetcher_close_while_producer_blocked():
    started = threading.Event()

    def make(i):
        started.set()
        return i

    def consume():
        p = Prefetcher(make, 0, 100, 2)
        started.wait(5)
        time.sleep(0.05)  # the thread has filled its 2 slots and waits for a free one
        p.close()
        assert not p._thread.is_alive()

    _run_with_timeout(consume)


def _wait_for(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetcher_depth_bound(depth):
    lock = threading.Lock()
    started = [0]

    def make(i):
        with lock:
            started[0] += 1
        return i

    def consume():
        with Prefetcher(make, 0, 20, depth) as p:
            _wait_for(lambda: started[0] >= depth)
            time.sleep(0.02)
            assert started[0] == depth  # filled up to depth before anything is consumed
            for consumed, item in enumerate(p, start=1):
                assert item == consumed - 1
                full = min(consumed + depth, 20)
                _wait_for(lambda f=full: started[0] >= f)  # it does keep depth items ready
                time.sleep(0.01)  # give the producer time to run further ahead if it could
                with lock:
                    ahead = started[0] - consumed
                assert ahead <= depth, f"producer {ahead} items ahead with depth={depth}"

    _run_with_timeout(consume)


def test_prefetcher_rejects_negative_depth():
    with pytest.raises(ValueError, match="depth=-1"):
        Prefetcher(str, 0, 1, -1)

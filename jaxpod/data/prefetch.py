"""`Prefetcher`: the next few items of a sequence computed ahead in a background thread.

The training loop wraps its host reads in one (`data.prefetch` batches or parts ahead, in
host memory), so reading step N+1.. overlaps the device's work on step N
(`jaxpod.data.feed.DeviceFeed` copies each to the device when its call comes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_ITEM, _ERROR, _DONE = 0, 1, 2


def _produce(
    make_item: Callable[[int], Any],
    items: range,
    out: queue.SimpleQueue,
    slots: threading.Semaphore,
    stop: threading.Event,
) -> None:
    """Prefetcher thread: make items in order, one free slot each, until done/error/stopped."""
    try:
        for i in items:
            slots.acquire()
            if stop.is_set():
                return
            out.put((_ITEM, make_item(i)))
    except BaseException as e:  # re-raised in the consumer
        out.put((_ERROR, e))
    finally:
        out.put((_DONE, None))


class Prefetcher(Generic[T]):
    """Iterate make_item(i) for i in range(start, stop), computed ahead in a background thread.

    At most `depth` items are ever in flight: the thread starts make_item(i) only when fewer
    than `depth` items it made are still waiting to be taken, so while the consumer works on
    item i, items i+1..i+depth can be ready. `depth=0` runs make_item synchronously in
    `__next__`. An exception in make_item is re-raised (same object, same type) by the
    `__next__` that would have returned that item. `close()` (or leaving the `with` block)
    stops the thread: it waits at most for the make_item call in progress. Single use.
    """

    def __init__(self, make_item: Callable[[int], T], start: int, stop: int, depth: int = 3):
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0 (data.prefetch)")
        self._make_item = make_item
        self._items = range(start, stop)
        self._next = 0  # position in _items of the next item to return
        self._depth = depth
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0 and len(self._items) > 0:
            self._thread = threading.Thread(
                target=_produce,
                args=(make_item, self._items, self._queue, self._slots, self._stop),
                name="jaxpod-prefetch",
                daemon=True,
            )
            self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed or self._next >= len(self._items):
            raise StopIteration
        if self._thread is None:
            item = self._make_item(self._items[self._next])
            self._next += 1
            return item
        kind, value = self._queue.get()
        if kind == _ITEM:
            self._next += 1
            self._slots.release()
            return value
        self.close()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop the thread and drop prefetched items; idempotent. Iteration then ends."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            self._slots.release()  # wake the thread if it waits for a slot
            self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._thread is not None:
                self._stop.set()
                self._slots.release()
        except AttributeError:  # __init__ failed early
            pass

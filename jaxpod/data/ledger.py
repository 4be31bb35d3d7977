"""`Ledger`: the bytes a data loader holds, by its own count, and the most it ever held.

A loader streams a corpus larger than memory only if what it holds is bounded by the batches
in flight, not by the corpus. It says so here: a fixed part (its index: paths, labels, the
visiting order), the arrays it handed out while they are alive (a `weakref.finalize` on each
releases it when the last reference goes), and the scratch it holds while it makes them
(decoded source images). `peak` is the most held at any moment. Thread-safe; numpy only.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


class Ledger:
    """Bytes held now (`held`) and at most (`peak`): `fixed` plus live arrays and scratch."""

    def __init__(self, fixed: int = 0):
        self._lock = threading.Lock()
        self.fixed = fixed
        self.held = fixed
        self.peak = fixed

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` more as held (and raise the peak if it is a new high)."""
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        """Count `nbytes` as given back."""
        with self._lock:
            self.held -= nbytes

    def track(self, array: np.ndarray) -> np.ndarray:
        """`array` (one the loader allocated, not a view) counted as held until it is freed."""
        self.hold(array.nbytes)
        weakref.finalize(array, self.release, array.nbytes)
        return array

    @contextmanager
    def scratch(self, nbytes: int) -> Iterator[None]:
        """`nbytes` counted as held inside the `with` block (a buffer made and dropped there)."""
        self.hold(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)

"""`DeviceFeed`: batches (or parts) copied to the device one at a time, as the planner counts.

A compiled step takes its batch as an argument; the planner's `inputs` row and XLA's argument
bytes count that one batch (with `train.batch_parts` > 1, one part). The feed keeps it so on
the device: it copies the next host batch in only once the call that read the one before has
finished, so no second batch waits on the device beside the running one. The batches ahead
wait in host memory (`HostBatch`, read by the loop's `Prefetcher`), as a pod's host keeps
them.

    feed = DeviceFeed(host_batches)
    state, metrics = engine.run_step(state, feed, dispatched=feed.dispatched)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax


def fetch_when_done(outputs: Any) -> Any:
    """`outputs` (a pytree of global arrays) as numpy, once every device's shard is computed:
    `jax.device_get` of a replicated array copies one device's shard and so waits for that
    device alone, which would stamp a time or copy the next batch while another still runs."""
    return jax.device_get(jax.block_until_ready(outputs))


def index_key(index: tuple) -> tuple:
    """A device's index into a global array (a tuple of slices) as a hashable key."""
    return tuple((i.start, i.stop, i.step) for i in index)


@dataclass(frozen=True)
class HostBatch:
    """A batch (or a part of one) in host memory: per array, its global shape, its sharding
    and the rows of each of this process's devices (`{index_key(index): np.ndarray}`)."""

    arrays: tuple[tuple[tuple[int, ...], jax.sharding.Sharding, dict], ...]

    def put(self) -> tuple[jax.Array, ...]:
        """Copy to the devices: one global array per batch array, sharded over the batch axes."""
        put = jax.make_array_from_callback
        return tuple(
            put(shape, sharding, lambda index, rows=rows: rows[index_key(index)])
            for shape, sharding, rows in self.arrays
        )


class DeviceFeed:
    """Iterate the device copies of `host_batches`: `next` waits for the outputs given to the
    last `dispatched` (those of the call that read the previous batch), then copies. `after`
    is the outputs of the call before the first batch's (another feed's call, e.g. the step
    that computed the parameters an evaluation reads), waited for likewise."""

    def __init__(self, host_batches: Iterable[HostBatch], after: Any = None):
        self._host = iter(host_batches)
        self._last: Any = after  # the outputs of the last dispatched call (never donated)

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        host = next(self._host)  # read ahead in host memory: may overlap the running call
        if self._last is not None:
            jax.block_until_ready(self._last)  # every device's part of that call is done
            self._last = None
        return host.put()

    def dispatched(self, outputs: Any) -> None:
        """Record the outputs of the call just dispatched on the batch `next` returned."""
        self._last = outputs

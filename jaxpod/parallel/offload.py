"""Host offload with JAX memory kinds, and a ledger of where the bytes are.

A pod's *streaming memory* is emulated with the `pinned_host` memory kind: arrays whose
`NamedSharding` has `memory_kind="pinned_host"` live in host RAM next to their device, and
`jax.device_put(x, jax.memory.Space.Device / Host)` inside a jitted function (or inside
`shard_map`) moves them. What the engine offloads (`memory.offload`, `memory.phases`):

- `optimizer`: the optimizer state's per-parameter leaves live in `pinned_host`; the step
  streams them to the device for the update and writes the new state back.
- `params` (and, for `phases > 1`, at least the layer stack): the master weights live in
  `pinned_host`; inside `shard_map` the non-layer weights are fetched at the start of the
  loss and the layer stack phase by phase (`jaxpod.parallel.stream.scan_layers`), each phase's
  weights right before it runs. A fetching phase is a checkpoint that does not save the
  fetched copy, so the backward pass fetches each phase again (the program's intent: a
  phase's weights device-resident at a time; see below for what XLA makes of it). Gradients
  of host weights come back through the transposed transfer and are moved to the device.
- `activations`: the remat policy's saved values are offloaded (`jaxpod.parallel.remat`).

What XLA schedules (observed on jax 0.10.2, CPU): every `device_put` to another memory kind
in the *GSPMD* part of the step (the optimizer update) lowers to an
`annotate_device_placement` custom call, i.e. an async copy between memory spaces that the
latency-hiding scheduler may overlap with compute on TPU/GPU. Inside `shard_map`, however,
`device_put(x, Space.Device)` lowers to *no* placement of its own: the host-resident
weights are brought to the device where the `shard_map` consumes them, i.e. once per step
for the whole local stack, not phase by phase. The phase structure (K scans, each phase a
checkpoint that does not save its weights) is in the program and the numbers are exact,
but per-phase streaming is not what XLA executes in this version. On the CPU backend both
memory kinds are host RAM and the copies are memcpys; the memory kinds of every live array
(what the ledger reports) are the real ones.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax

HOST = "pinned_host"
DEVICE = "device"


def to_device(tree: Any) -> Any:
    """Inside jit/shard_map: move every leaf to device memory (a no-op for those there)."""
    return jax.device_put(tree, jax.memory.Space.Device)


def to_host(tree: Any) -> Any:
    """Inside jit/shard_map: move every leaf to pinned host memory."""
    return jax.device_put(tree, jax.memory.Space.Host)


def with_memory_kind(shardings: Any, kind: str) -> Any:
    """The same `NamedSharding`s in memory kind `kind`."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def live_bytes(tree: Any) -> dict[int, dict[str, int]]:
    """Bytes each device holds of `tree`'s arrays, by memory kind:
    `{device id: {"device": n, "pinned_host": m}}` (measured from `addressable_shards`)."""
    held: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or DEVICE
        for shard in leaf.addressable_shards:
            held[shard.device.id][kind] += shard.data.nbytes
    return {d: dict(kinds) for d, kinds in sorted(held.items())}


def ledger(state: Any, compiled: Any | None = None) -> dict[str, Any]:
    """Device-memory ledger of a run: live bytes of `state` per device by memory kind, and,
    given the compiled step (`jitted.lower(...).compile()`), its temporary bytes.

    Returns `{"per_device": {id: {kind: bytes}}, "device_resident_max": bytes,
    "host_resident_max": bytes, "temp_bytes": int | None, "device_total_max": bytes}`,
    where `device_total_max` = the largest device-resident live bytes + temp bytes: what one
    device needs at the step's peak (XLA's temp buffers hold activations, gradients and
    fetched phase weights; donation means the state is not counted twice).
    """
    per = live_bytes(state)
    on_device = max((k.get(DEVICE, 0) for k in per.values()), default=0)
    on_host = max((k.get(HOST, 0) for k in per.values()), default=0)
    temp = None
    if compiled is not None:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return {
        "per_device": per,
        "device_resident_max": on_device,
        "host_resident_max": on_host,
        "temp_bytes": temp,
        "device_total_max": on_device + (temp or 0),
    }

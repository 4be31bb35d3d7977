"""Host offload with JAX memory kinds.

A pod's *streaming memory* is emulated with the `pinned_host` memory kind: arrays whose
`NamedSharding` has `memory_kind="pinned_host"` live in host RAM next to their device, and
`jax.device_put(x, jax.memory.Space.Device / Host)` inside a jitted function (or inside
`shard_map`) moves them. What the engine offloads (`memory.offload`, `memory.phases`):

- `optimizer`: the optimizer state's per-parameter leaves live in `pinned_host`; the step
  moves them to the device, whole, for the update and writes the new state back.
- `params` (and, for `phases > 1`, at least the layer stack): the master weights live in
  `pinned_host`; inside `shard_map` the non-layer weights are fetched at the start of the
  loss and the layer stack phase by phase (`jaxpod.parallel.stream.scan_phases`), each phase's
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
memory kinds are host RAM and the copies are memcpys.
"""

from __future__ import annotations

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

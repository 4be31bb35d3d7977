"""Host offload with JAX memory kinds.

A pod's *streaming memory* is emulated with the `pinned_host` memory kind: arrays whose
`NamedSharding` has `memory_kind="pinned_host"` live in host RAM next to their device, and
`jax.device_put(x, jax.memory.Space.Device / Host)` inside a jitted function (or inside
`shard_map`) moves them. What the engine offloads (`memory.offload`, `memory.phases`):

- `optimizer`: the optimizer state lives in `pinned_host`; the step moves it to the device,
  whole, for the update and writes the new state back.
- `params`: the master weights live in `pinned_host`; inside `shard_map` the non-layer
  weights are fetched before use and the layer stack phase by phase, or step by step with
  `memory.stream=matrix` (`jaxpod.parallel.matrix_stream`), each a checkpoint that does not save
  the fetched copy; a pipelined stage fetches its whole stack before the GPipe ticks. The
  update moves the weights to the device whole.
- `activations`: the remat policy asks for its saved values on the host
  (`jaxpod.parallel.remat`).

Which of these transfers a program has depends on the platform it is lowered for: jax
lowers a placement inside jit (these `device_put`s, a remat policy's offload) for TPU and GPU
only. The TPU/GPU program does all of the above; the CPU program, which XLA:CPU compiles, has
no transfer inside the step and reads the host-resident state in place (one RAM). What the
planner counts of each: docs/memory.md; tests/planner/test_transfers.py reads both programs.
"""

from __future__ import annotations

import re
from collections import Counter
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


# An `annotate_device_placement` in lowered StableHLO: its value, memory kind and type.
_PLACEMENT = re.compile(
    r'(%\w+) = stablehlo.custom_call @annotate_device_placement.*_xla_buffer_placement = "(\w+)"'
    r".*\) -> (tensor<[^>]*>)"
)


def placements(lowered_text: str) -> tuple[Counter, Counter]:
    """`(transfers, results)` of a lowered step's text: `Counter`s of (memory kind, type)
    of its `annotate_device_placement`s inside the step, and of those on the values its
    entry function returns (where the new state goes: no transfer inside the step)."""
    start = lowered_text.index("func.func public @main")
    entry = lowered_text[start : lowered_text.index("\n  }\n", start)]
    returned = set(re.findall(r"%\w+", entry.splitlines()[-1]))
    at_return = {m.group(0) for m in _PLACEMENT.finditer(entry) if m.group(1) in returned}
    transfers, results = Counter(), Counter()
    for m in _PLACEMENT.finditer(lowered_text):
        (results if m.group(0) in at_return else transfers)[m.group(2), m.group(3)] += 1
    return transfers, results

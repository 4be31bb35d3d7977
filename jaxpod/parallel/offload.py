"""Host offload with JAX memory kinds.

A pod's *streaming memory* is emulated with the `pinned_host` memory kind: arrays whose
`NamedSharding` has `memory_kind="pinned_host"` live in host RAM next to their device, and
`jax.device_put(x, jax.memory.Space.Device / Host)` inside a jitted function (or inside
`shard_map`) moves them. What the engine offloads (`memory.offload`, `memory.phases`):

- `optimizer`: the optimizer state lives in `pinned_host`; the step moves it to the device
  for the update and writes the new state back: whole, or with `memory.phases` and no
  pipeline one phase of the layer stack at a time (`jaxpod.optim.phased`).
- `params`: the master weights live in `pinned_host`; inside `shard_map` the non-layer
  weights are fetched before use and the layer stack's matrices phase by phase, or step by
  step with `memory.stream=matrix` (`jaxpod.parallel.matrix_stream`), each a checkpoint
  that does not save the fetched copy, in every micro-batch (biases and norms are fetched
  whole); a pipelined stage fetches its whole stack before the GPipe ticks.
- `activations`: the remat policy asks for its saved values on the host
  (`jaxpod.parallel.remat`).

Which of these transfers a program has depends on the platform it is lowered for: jax
lowers a placement inside jit (these `device_put`s, a remat policy's offload) for TPU and GPU
only. The TPU/GPU program does all of the above; the CPU program, which XLA:CPU compiles, has
no transfer inside the step and reads the host-resident state in place (one RAM). What the
planner counts of each: docs/memory.md; tests/planner/test_transfers.py reads both programs.
Gradients stay in device memory (`value_and_grad`, `Resting`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpod.parallel.manual import vary_like

HOST = "pinned_host"
DEVICE = "device"


class Resting(NamedTuple):
    """A host-resident array inside a step differentiated by `value_and_grad`: `host`, the
    array in host memory, and `stand_in`, a zero of its shape in device memory that is
    differentiated in its place. jax types a host-resident value's cotangent as
    host-resident (the transpose of its fetch moves the gradient to the host), so the
    differentiated step never takes one as a variable. A pytree of two leaves:
    `jax.tree.map` slices both alike, so a slice of a pair is the pair of the slices."""

    host: jax.Array
    stand_in: jax.Array


def is_resting(x: Any) -> bool:
    """Whether `x` is a `Resting` pair (a leaf for `jax.tree.map(..., is_leaf=is_resting)`)."""
    return isinstance(x, Resting)


def on_host(x: Any) -> bool:
    """Whether a traced array (or a `Resting` pair) lives in host memory."""
    return is_resting(x) or jax.typeof(x).memory_space == jax.memory.Space.Host


@jax.custom_vjp
def _fetch(host: jax.Array, stand_in: jax.Array) -> jax.Array:
    return jax.device_put(host, jax.memory.Space.Device)


def _fetch_fwd(host, stand_in):
    return _fetch(host, stand_in), None


def _fetch_bwd(_, grad):
    return None, grad  # the host value is a constant; its gradient stays on the device


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


def to_device(tree: Any) -> Any:
    """Inside jit/shard_map: every host-resident leaf of `tree` in device memory (a
    `Resting` pair fetched so that its gradient is its stand-in's); the others as they are."""

    def fetch(x):
        if is_resting(x):
            return _fetch(x.host, x.stand_in)
        return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x

    return jax.tree.map(fetch, tree, is_leaf=is_resting)


def value_and_grad(fn: Callable, *, has_aux: bool = False) -> Callable:
    """`jax.value_and_grad(fn, has_aux=has_aux)` with respect to the first argument, a tree
    whose host-resident leaves reach `fn` as `Resting` pairs: their gradients are made, and
    returned, in device memory (no cotangent is ever moved to the host). Nothing is computed
    on a host-resident value but the slices a fetch reads (XLA:TPU compiles any other
    computation on one as a host program)."""

    def stand_in(a):
        return vary_like(jnp.zeros(a.shape, a.dtype), a) if on_host(a) else a

    def run(params, *args):
        def paired(stand_ins, *args):
            pair = lambda a, s: Resting(a, s) if on_host(a) else s  # noqa: E731
            return fn(jax.tree.map(pair, params, stand_ins), *args)

        stand_ins = jax.tree.map(stand_in, params)
        return jax.value_and_grad(paired, has_aux=has_aux)(stand_ins, *args)

    return run


def to_host(tree: Any) -> Any:
    """Inside jit/shard_map: move every leaf to pinned host memory."""
    return jax.device_put(tree, jax.memory.Space.Host)


def put_back(new: jax.Array, old: jax.Array) -> jax.Array:
    """Inside jit: `new` in the memory `old` lives in (host or device)."""
    return to_host(new) if on_host(old) else new


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

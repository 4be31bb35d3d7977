"""A layer's stored weights made ready right before use, inside the layer's remat unit.

`make_ready(prepare, fetch, remat_policy)` is what every way of running the stack calls on a
layer's (or a step's) stored weights: fetched from host memory if each step fetches its own
(one layer's slice of the stack, its panels taken on the device), then the caller's
`prepare` (the RTS all-gather, the cast to the compute dtype), tied to the layer's input
under remat (`depend_on`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpod.parallel.replica import take_panels


def depend_on(weights, x: jax.Array):
    """`weights` unchanged (`w + 0 * x[0]`), but now a function of `x`, so what `prepare`
    does with them next (the RTS all-gather, the cast) can only run once this layer's input
    exists: per layer *and per pipeline tick*, one layer's gathered weights alive at a time.
    Otherwise a stage's weights are the same on every GPipe tick, XLA hoists their gather out
    of the tick loop and holds the whole stage gathered, and a scheduler may start every
    phase's gather at once (an `optimization_barrier` stops the hoisting but not the
    scheduler). A leaf whose varying axes do not cover `x`'s is left
    alone (the sum would widen its type)."""
    token = x.reshape(-1)[0]
    vma = lambda a: getattr(jax.typeof(a), "vma", frozenset())
    zero = jnp.nan_to_num(token) * 0  # finite, so the sum is exact

    def depending_on_x(w):
        return w + zero.astype(w.dtype) if vma(token) <= vma(w) else w

    return jax.tree.map(depending_on_x, weights)


def make_ready(prepare: Callable | None, fetch: Callable | None, remat_policy: str) -> Callable:
    """`ready(params, x, panels=None, index=None)`: stored params -> what is computed with.
    `fetch` (not None: each step fetches its own weights): `params` is the whole `[L, ...]`
    stack of the step's leaves and layer `index` of it is fetched (`read_layer`), its
    `panels` taken after, on the device. Then `prepare(params, panels)`, or without one the
    panels taken. Recomputed in the backward pass (`remat_policy` not `none`), the weights
    are first made a function of `x` so that their gather runs per layer and per tick."""

    def ready(params, x, panels=None, index=None):
        if fetch is not None:  # this step's leaves of layer `index`, fetched
            params = fetch(read_layer(params, index))
        if prepare is None:
            return take_panels(params, panels)
        if remat_policy != "none":  # recomputed in the backward pass: gather it per tick
            params = depend_on(params, x)
        return prepare(params, panels)

    return ready


def read_layer(tree: dict, index) -> dict:
    """Layer `index` of each `[L, ...]` leaf of `tree`: one slice of the whole leaf along its
    layer axis alone, so a host-resident leaf is read by one transfer and nothing is computed
    on it (XLA:TPU reads a slice of host memory along one axis only; a panel, a slice of
    two, is taken on the device)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), tree)

"""The plain layer scan: one stage's stacked layers applied in turn by one `lax.scan`, or
traced one by one (`loop`)."""

from __future__ import annotations

from collections.abc import Callable

import jax


def scan_layers(
    layer_fn: Callable, x: jax.Array, stacked: dict, unroll: bool = False, loop: bool = False
):
    """`layer_fn(x, one_layer_params) -> x` over every layer of `stacked` (`[L, ...]`
    leaves), in one `lax.scan`: compile time does not grow with depth. `loop`: each layer
    traced in turn instead (no scan: the values a layer saves for the backward pass are
    not stacked over the layers; `StackOptions.layer_loop`)."""
    if loop:
        for i in range(jax.tree.leaves(stacked)[0].shape[0]):
            x = layer_fn(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        return x
    return jax.lax.scan(lambda c, p: (layer_fn(c, p), None), x, stacked, unroll=unroll)[0]

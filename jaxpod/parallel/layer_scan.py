"""The plain layer scan: one stage's stacked layers applied in turn by one `lax.scan`."""

from __future__ import annotations

from collections.abc import Callable

import jax


def scan_layers(layer_fn: Callable, x: jax.Array, stacked: dict, unroll: bool = False):
    """`layer_fn(x, one_layer_params) -> x` over every layer of `stacked` (`[L, ...]`
    leaves), in one `lax.scan`: compile time does not grow with depth."""
    return jax.lax.scan(lambda c, p: (layer_fn(c, p), None), x, stacked, unroll=unroll)[0]

"""Inside `shard_map`: which manual mesh axes a value varies over, and marking it so.

`shard_map` checks that a scan's carry has the same varying axes on every iteration; a
carry initialised with zeros varies over none, so it is cast (`jax.lax.pcast`, no data
moves) to vary like the values it will hold.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which `x` (an array or `ShapeDtypeStruct`) may differ."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = aval.manual_axis_type  # None outside shard_map (and for a plain eval_shape)
    return frozenset() if manual is None else manual.varying


def vary_like(x: jax.Array, like) -> jax.Array:
    """Mark `x` as varying over the same manual mesh axes as `like` (scan carries must agree)."""
    missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

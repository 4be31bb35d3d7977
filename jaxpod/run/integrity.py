"""What a restored checkpoint must match: every array's checksum, and every array's path,
shape and dtype.

A checksum is two uint32 sums of an array's bits (plain and position-weighted), computed on
the devices that hold it: integer sums are exact in any order, so it does not depend on the
sharding that saved or restores it. `jaxpod.run.checkpoint` keeps them in a checkpoint's
record and checks them, and the model's shapes, after every restore; a mismatch is a one-line
`UserError` naming the array.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.engine import TrainState
from jaxpod.errors import UserError

_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash: position weights of a checksum


def _part(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)  # pragma: no cover


def leaf_paths(tree) -> list[tuple[str, ...]]:
    """The path of every leaf of `tree`, as strings (dict keys, field names, indices)."""
    return [tuple(_part(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def by_path(nested, prefix: tuple[str, ...] = ()) -> dict[str, object]:
    """`{"params.layers.mlp.w_in": leaf, ...}` of a nested dict (any mapping-like metadata)."""
    if hasattr(nested, "items"):
        out: dict[str, object] = {}
        for key, value in nested.items():
            out.update(by_path(value, (*prefix, str(key))))
        return out
    return {".".join(prefix): nested}


def _shape(leaf) -> str:
    return f"{list(leaf.shape)} {jax.numpy.dtype(leaf.dtype).name}"


def _bits(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 values, elementwise (same shape, same sharding)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_ or size not in (1, 2, 4):
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_sums(x: jax.Array) -> jax.Array:
    """uint32[2]: the sum of `x`'s bits and their position-weighted sum (mod 2^32). Integer
    sums are exact in any order, so the result does not depend on the sharding. A leaf in
    host memory (`memory.offload`) is read into device memory first."""
    x = jax.device_put(x, jax.memory.Space.Device)
    bits = _bits(x)
    position = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(x.ndim)):
        position += jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * np.uint32(stride)
        stride = (stride * x.shape[dim]) % 2**32
    weights = position * _GOLDEN + np.uint32(1)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)])


_sums = jax.jit(lambda leaves: [_leaf_sums(x) for x in leaves])


def checksums(state: TrainState) -> dict[str, list[int]]:
    """`{"params.layers.mlp.w_in": [sum, weighted sum], ...}` of every array of `state`."""
    sums = _sums(jax.tree.leaves(state))
    host = [np.asarray(s.addressable_data(0)).tolist() for s in sums]  # replicated scalars
    return {".".join(p): v for p, v in zip(leaf_paths(state), host, strict=True)}


def check_sums(where: Path, saved: dict, here: dict, fix: str) -> None:
    """One-line `UserError` naming the first array whose checksum differs from the saved one."""
    for path in sorted(here):
        if saved.get(path) != here[path]:
            raise UserError(
                f"checkpoint {where} is damaged: {path} does not match the checksum saved with "
                f"it (its bytes under {where}/state changed after saving); {fix}"
            )


def check_matches(where: Path, saved: dict[str, object], here: dict[str, object]) -> None:
    """One-line `UserError` naming the first parameter path whose shape/dtype differ."""
    fix = "use a fresh train.logdir or the same model.* and optim.*"
    head = f"checkpoint {where} does not match the model:"
    for path in sorted(set(saved) | set(here), key=lambda p: (not p.startswith("params."), p)):
        if path not in here or path not in saved:
            side = "the checkpoint only" if path in saved else "the model only"
            raise UserError(f"{head} {path} is in {side}; {fix}")
        a, b = saved[path], here[path]
        if tuple(a.shape) != tuple(b.shape) or jax.numpy.dtype(a.dtype) != b.dtype:
            raise UserError(f"{head} {path} is {_shape(a)} there but {_shape(b)} here; {fix}")

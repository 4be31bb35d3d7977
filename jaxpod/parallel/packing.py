"""Pack per-stage pytrees of *different* structure into one buffer per dtype, `[S, n_max]`.

A heterogeneous pipeline (a CNN's stem + early blocks on stage 0, late blocks + head on
stage 1) has a different parameter tree on every stage. JAX arrays cannot live on a subset
of a mesh inside one jitted program, so the stages' trees are flattened into rows of one
buffer per dtype, padded to the largest stage, and the buffer is sharded over `pipeline`:

    buffers["float32"]  [S, n_max]   P("pipeline", None)   device of stage s holds row s

Each stage's leaves therefore live only on that stage's devices (plus at most
`n_max - n_s` padding). Inside `shard_map` a device sees its `[1, n_max]` row and
`unpack(row, s)` rebuilds stage `s`'s tree (one static split + reshapes, free under jit).
The same packing holds optimizer state (moments, step counts) of each stage.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class _Slot:
    """Where one leaf lives: dtype buffer name, offset, shape."""

    __slots__ = ("dtype", "offset", "shape", "size")

    def __init__(self, dtype: str, offset: int, shape: tuple[int, ...]):
        self.dtype, self.offset, self.shape = dtype, offset, shape
        self.size = math.prod(shape)


class StagePacking:
    """The layout of S stage trees in per-dtype buffers `{dtype: [S, n_max]}`.

    Built from abstract trees (anything with `.shape` and `.dtype`, e.g. ShapeDtypeStructs),
    so a 175 B-parameter layout costs nothing to plan.
    """

    def __init__(self, trees: list[Any]):
        self.treedefs = []
        self.slots: list[list[_Slot]] = []
        sizes: dict[str, int] = {}
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            self.treedefs.append(treedef)
            offsets: dict[str, int] = {}
            slots = []
            for leaf in leaves:
                name = jnp.dtype(leaf.dtype).name
                slots.append(_Slot(name, offsets.get(name, 0), tuple(leaf.shape)))
                offsets[name] = offsets.get(name, 0) + slots[-1].size
            self.slots.append(slots)
            for name, n in offsets.items():
                sizes[name] = max(sizes.get(name, 0), n)
        self.row_sizes = {name: max(n, 1) for name, n in sorted(sizes.items())}

    @property
    def num_stages(self) -> int:
        return len(self.slots)

    def stage_sizes(self, stage: int) -> dict[str, int]:
        """Elements of each dtype that stage `stage` really uses (the rest of its row pads)."""
        out: dict[str, int] = {}
        for slot in self.slots[stage]:
            out[slot.dtype] = out.get(slot.dtype, 0) + slot.size
        return out

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """`{dtype: ShapeDtypeStruct([S, n_max])}`."""
        return {
            name: jax.ShapeDtypeStruct((self.num_stages, n), jnp.dtype(name))
            for name, n in self.row_sizes.items()
        }

    def pack_row(self, tree: Any, stage: int, float_dtype=None) -> dict[str, jax.Array]:
        """Stage `stage`'s tree -> `{dtype: [n_max]}` (zero padded).

        With `float_dtype` (e.g. float32 updates of float16 weights), floating buffers hold
        that dtype instead of their own (keys unchanged); integer buffers are unaffected."""

        def dtype_of(name: str):
            floating = jnp.issubdtype(jnp.dtype(name), jnp.floating)
            return float_dtype if float_dtype is not None and floating else name

        leaves = self.treedefs[stage].flatten_up_to(tree)
        parts: dict[str, list[jax.Array]] = {name: [] for name in self.row_sizes}
        for slot, leaf in zip(self.slots[stage], leaves, strict=True):
            parts[slot.dtype].append(jnp.ravel(leaf).astype(dtype_of(slot.dtype)))
        row = {}
        for name, n in self.row_sizes.items():
            dtype = dtype_of(name)
            flat = jnp.concatenate(parts[name]) if parts[name] else jnp.zeros((0,), dtype)
            row[name] = jnp.pad(flat, (0, n - flat.shape[0]))
        return row

    def pack(self, trees: list[Any]) -> dict[str, jax.Array]:
        """All stages' trees -> `{dtype: [S, n_max]}`."""
        rows = [self.pack_row(tree, s) for s, tree in enumerate(trees)]
        return {name: jnp.stack([r[name] for r in rows]) for name in self.row_sizes}

    def unpack(self, row: dict[str, jax.Array], stage: int) -> Any:
        """`{dtype: [n_max]}` -> stage `stage`'s tree.

        One `split` per dtype buffer (static sizes), so the gradient of a row is one
        `concatenate` of the leaves' gradients. Slicing each leaf out separately would make
        it a sum of one zero-padded row per leaf, which XLA fuses into a loop that visits
        every leaf for every element of the row (O(leaves x row))."""
        pieces = {}  # dtype -> its leaves' pieces in order (then the row's padding)
        for name, buf in row.items():
            sizes = [s.size for s in self.slots[stage] if s.dtype == name]
            pieces[name] = iter(jnp.split(buf, np.cumsum(sizes).tolist()))
        leaves = [next(pieces[s.dtype]).reshape(s.shape) for s in self.slots[stage]]
        return self.treedefs[stage].unflatten(leaves)

    def unpack_all(self, buffers: dict[str, Any]) -> list[Any]:
        """`{dtype: [S, n_max]}` (host or device) -> every stage's tree (for tests and export)."""
        return [
            self.unpack({k: jnp.asarray(np.asarray(v)[s]) for k, v in buffers.items()}, s)
            for s in range(self.num_stages)
        ]

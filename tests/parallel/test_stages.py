"""Packing heterogeneous pipeline stages (`jaxpod.parallel.stages.StagePacking`): one row
per stage and dtype, padded, unpacked to the same trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def test_stage_packing_round_trip():
    from jaxpod.parallel.stages import StagePacking

    trees = [
        {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.int32(7), "h": jnp.ones(3, jnp.float16)},
        {"a": [jnp.full((4,), 2.0), jnp.zeros((1, 1))]},
    ]
    packing = StagePacking(trees)
    assert packing.row_sizes == {"float16": 3, "float32": 6, "int32": 1}
    assert packing.stage_sizes(1) == {"float32": 5}
    buffers = packing.pack(trees)
    assert {k: v.shape for k, v in buffers.items()} == {
        "float16": (2, 3),
        "float32": (2, 6),
        "int32": (2, 1),
    }
    for got, want in zip(packing.unpack_all(buffers), trees, strict=True):
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, w), got, want)
        assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
    assert float(buffers["float32"][1, 5]) == 0.0  # padding

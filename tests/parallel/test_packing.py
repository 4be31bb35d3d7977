"""Packing heterogeneous pipeline stages (`jaxpod.parallel.packing.StagePacking`): one row
per stage and dtype, padded, unpacked to the same trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def test_stage_packing_round_trip():
    from jaxpod.parallel.packing import StagePacking

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


def test_a_row_gradient_is_one_concatenate():
    """The gradient of a row through `unpack` is the leaves' gradients concatenated (one
    `concatenate`, no per-leaf zero-padded rows to sum: that sum visits every leaf for every
    element of the row), and equals the plain per-leaf gradient placed at each leaf's slot."""
    from jaxpod.parallel.packing import StagePacking

    trees = [{"w": jnp.ones((2, 3)), "b": jnp.ones(4), "s": jnp.ones(())}, {"v": jnp.ones(20)}]
    packing = StagePacking(trees)
    weights = {"w": 1.0, "b": 2.0, "s": 3.0}

    def loss(row):
        tree = packing.unpack({"float32": row}, 0)
        return sum(weights[k] * jnp.sum(v**2) for k, v in tree.items())

    row = jnp.arange(20.0)
    grad = jax.jit(jax.grad(loss))
    hlo = grad.lower(row).as_text()
    assert hlo.count("stablehlo.concatenate") == 1 and "stablehlo.pad" not in hlo
    want = np.zeros(20, np.float32)
    for slot, key in zip(packing.slots[0], ["b", "s", "w"], strict=True):  # flattened order
        want[slot.offset : slot.offset + slot.size] = (
            2 * weights[key] * np.arange(slot.offset, slot.offset + slot.size)
        )
    np.testing.assert_array_equal(np.asarray(grad(row)), want)

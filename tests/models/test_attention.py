"""Self-attention over query blocks (`chunks`, what `model.sequence_chunks` uses) is the same
math as over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.lab import GRAD_TOL, assert_trees_close


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_sequence_chunks_are_the_same_math(causal):
    """Attention over 4 query blocks (lax.map, each a checkpoint) == one block: outputs and
    gradients (w.r.t. weights and input) of a single layer, float32, to rounding."""
    from jaxpod.models.attention import SelfAttention

    x = jax.random.normal(jax.random.key(1), (2, 16, 32))

    def value_and_grads(chunks):
        layer = SelfAttention(32, 4, rngs=nnx.Rngs(0), causal=causal, chunks=chunks)
        graphdef, params = nnx.split(layer)
        params = nnx.to_pure_dict(params)
        fn = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, None)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(params, x)

    (want, want_grads), (got, got_grads) = value_and_grads(1), value_and_grads(4)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_trees_close(got_grads, want_grads, GRAD_TOL, f"sequence chunks causal={causal}")

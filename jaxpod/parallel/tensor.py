"""Megatron-style tensor-parallel kernels, written for the inside of `jax.shard_map`.

Every function takes the *local* shard of its weights and an `axis` name. With `axis=None`
they are the plain single-device math (no collectives), which is what the reference path
and the tests compare against. Notation (scaling-book style): `W_in[D, F_tensor]` is a
matrix whose second dimension is split over the `tensor` mesh axis.

Collectives per transformer layer, forward: one `psum` after attention's output
projection and one after the MLP's second matmul. In the backward pass JAX inserts the
matching all-reduces on the activations' gradients (the transpose of the implicit
`pvary` that happens when a tensor-replicated activation meets a tensor-sharded weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Remat policies may save values tagged with this name so the backward pass never
# recomputes (and re-synchronises) a collective.
COLLECTIVE_OUT = "tensor_collective_out"


def column_dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """`x[..., D] @ W[D, F_tensor] (+ b[F_tensor]) -> y[..., F_tensor]`; no communication.

    `w` may have extra trailing dims (e.g. `W_qkv[D, 3, HD_tensor]`): it contracts `x`'s
    last dim with `w`'s first.
    """
    y = jnp.tensordot(x, w, axes=1)
    return y if b is None else y + b


def row_dense(x: jax.Array, w: jax.Array, b: jax.Array | None, axis: str | None) -> jax.Array:
    """`x[..., F_tensor] @ W[F_tensor, D]`, summed over `axis`, plus `b[D]` (replicated).

    The one `psum` of a Megatron MLP / attention block: each shard holds a partial sum.
    """
    y = jnp.tensordot(x, w, axes=1)
    if axis is not None:
        y = checkpoint_name(jax.lax.psum(y, axis), COLLECTIVE_OUT)
    return y if b is None else y + b


def _vocab_range(table: jax.Array, axis: str | None) -> tuple[jax.Array | int, int]:
    """First vocabulary id held by this shard and the shard's size (`table[V_tensor, D]`)."""
    size = table.shape[0]
    start = 0 if axis is None else jax.lax.axis_index(axis) * size
    return start, size


def vocab_embed(tokens: jax.Array, table: jax.Array, axis: str | None) -> jax.Array:
    """Vocab-parallel embedding: `tokens[...] int`, `table[V_tensor, D]` -> `x[..., D]`.

    Each shard looks up the ids in its vocabulary range (zeros elsewhere); a `psum` over
    `axis` assembles the full embedding. No shard ever holds the whole table.
    """
    if axis is None:
        return jnp.take(table, tokens, axis=0)
    start, size = _vocab_range(table, axis)
    local = tokens - start
    inside = (local >= 0) & (local < size)
    x = jnp.take(table, jnp.clip(local, 0, size - 1), axis=0)
    x = jnp.where(inside[..., None], x, 0)
    return jax.lax.psum(x, axis)


def vocab_cross_entropy(
    h: jax.Array, table: jax.Array, targets: jax.Array, axis: str | None
) -> jax.Array:
    """Per-token cross-entropy of `logits = h @ table.T` without gathering the logits.

    Shapes: `h[..., D]`, `table[V_tensor, D]` (the tied embedding or the output projection),
    `targets[...]` int -> `loss[...]` float32. Each shard computes `logits[..., V_tensor]`;
    the softmax normaliser is assembled with a `pmax` and a `psum` of per-token scalars and
    the target logit with one more `psum`, so only `O(tokens)` numbers cross the wire.
    """
    logits = jnp.tensordot(h, table, axes=((h.ndim - 1,), (1,))).astype(jnp.float32)
    start, size = _vocab_range(table, axis)
    # The max only stabilises exp(); it cancels in the loss, so no gradient flows through it.
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    if axis is not None:
        shift = jax.lax.pmax(shift, axis)
    z = logits - shift[..., None]
    sum_exp = jnp.sum(jnp.exp(z), axis=-1)
    local = targets - start
    inside = (local >= 0) & (local < size)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1)[..., None], axis=-1)[..., 0]
    picked = jnp.where(inside, picked, 0.0)
    if axis is not None:
        sum_exp, picked = jax.lax.psum((sum_exp, picked), axis)
    return jnp.log(sum_exp) - picked

"""Chunked application: the same math on equal chunks of a tensor, one chunk's intermediates
alive at a time (the serialisation factor of pod recipes: attention queries, MLP tokens,
the loss head). Math only: no mesh, no device logic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.parallel.manual import vary_like


def map_chunks(fn: Callable, x: jax.Array, chunks: int, axis: int) -> jax.Array:
    """`fn(chunk, i)` on each of `chunks` equal chunks of `x` along `axis`, one after
    another (a scan), each chunk a checkpoint: only one chunk's intermediates are ever
    alive, forward or backward (they are recomputed, never saved). The chunks' outputs are
    written back in place along `axis`. `chunks=1` is `fn(x, 0)`.

    The serialisation factor of pod recipes (attention queries, MLP tokens, the loss head):
    the same math, 1/chunks of the working memory, a little recomputation.
    """
    if chunks == 1:
        return fn(x, 0)
    axis %= x.ndim
    n = x.shape[axis] // chunks
    chunk = jax.checkpoint(lambda i: fn(jax.lax.dynamic_slice_in_dim(x, i * n, n, axis), i))
    like = jax.eval_shape(chunk, 0)

    def body(out, i):  # each chunk's output written into place: no stacked copies
        return jax.lax.dynamic_update_slice_in_dim(out, chunk(i), i * like.shape[axis], axis), None

    shape = (*like.shape[:axis], chunks * like.shape[axis], *like.shape[axis + 1 :])
    out = vary_like(jnp.zeros(shape, like.dtype), like)
    return jax.lax.scan(body, out, jnp.arange(chunks))[0]


def token_loss_in_chunks(
    model: nnx.Module, h: jax.Array, targets: jax.Array, tp: str | None, chunks: int, **kw
) -> jax.Array:
    """`model.token_loss` of `h[..., D]` against `targets[...]` -> `loss[N]` (tokens
    flattened), the N tokens in `gcd(chunks, N)` chunks (`map_chunks`): one chunk's logits
    `[N/chunks, V_tensor]` alive at a time instead of all of them. `kw`: passed on to
    `token_loss`."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    chunks = math.gcd(chunks, targets.shape[0])
    n = targets.shape[0] // chunks
    chunk_loss = lambda hc, i: model.token_loss(
        hc, jax.lax.dynamic_slice_in_dim(targets, i * n, n), tp, **kw
    )
    return map_chunks(chunk_loss, h, chunks, axis=0)

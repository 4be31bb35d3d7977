"""Megatron-style tensor-parallel kernels, written for the inside of `jax.shard_map`.

Every function takes the *local* shard of its weights and an `axis` name. With `axis=None`
they are the plain single-device math (no collectives), which is what the reference path
and the tests compare against. Notation (scaling-book style): `W_in[D, F_tensor]` is a
matrix whose second dimension is split over the `tensor` mesh axis.

Collectives per transformer layer, forward: one `psum` after attention's output
projection and one after the MLP's second matmul. In the backward pass JAX inserts the
matching all-reduces on the activations' gradients (the transpose of the implicit
`pvary` that happens when a tensor-replicated activation meets a tensor-sharded weight).

Sequence parallelism (Megatron-SP, `model.sequence_parallel`): between the tensor-parallel
matmuls the residual stream `x[B, T_tensor, D]` is split over `tensor` along the sequence,
so LayerNorms, residual adds, dropout-free elementwise math and the activations saved or
carried between layers and pipeline stages are 1/t the size. Each all-reduce becomes its
two halves: `gather_sequence` (all-gather over T) before the column-parallel matmul and a
reduce-scatter over T (`row_dense(..., scatter=True)`) after the row-parallel one — the
same bytes on the wire as the psum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpod.parallel.manual import vary_like

# Remat policies may save values tagged with this name so the backward pass never
# recomputes (and re-synchronises) a collective.
COLLECTIVE_OUT = "tensor_collective_out"
# The attention's projections, tagged by the layer that computes them: the values the
# `attention` remat policy keeps (`jaxpod.parallel.remat`).
ATTENTION_QKV = "qkv"
ATTENTION_OUT = "attn_out"


def column_dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """`x[..., D] @ W[D, F_tensor] (+ b[F_tensor]) -> y[..., F_tensor]`; no communication.

    `w` may have extra trailing dims (e.g. `W_qkv[D, 3, HD_tensor]`): it contracts `x`'s
    last dim with `w`'s first.
    """
    y = jnp.tensordot(x, w, axes=1)
    return y if b is None else y + b


def row_dense(
    x: jax.Array, w: jax.Array, b: jax.Array | None, axis: str | None, scatter: bool = False
) -> jax.Array:
    """`x[..., T, F_tensor] @ W[F_tensor, D]`, summed over `axis`, plus `b[D]` (replicated).

    The one `psum` of a Megatron MLP / attention layer: each shard holds a partial sum.
    `scatter=True` (sequence parallelism) reduce-scatters over the sequence instead:
    `-> y[..., T / |axis|, D]`, this shard's range of positions.
    """
    return reduce_rows(jnp.tensordot(x, w, axes=1), b, axis, scatter)


def reduce_rows(
    y: jax.Array, b: jax.Array | None, axis: str | None, scatter: bool = False
) -> jax.Array:
    """The collective half of `row_dense`: sum the partial sums `y[..., T, D]` over `axis`
    (or reduce-scatter them over T), then add the replicated bias `b[D]`."""
    if axis is not None and scatter:
        y = jax.lax.psum_scatter(y, axis, scatter_dimension=y.ndim - 2, tiled=True)
        y = checkpoint_name(y, COLLECTIVE_OUT)
    elif axis is not None:
        y = checkpoint_name(jax.lax.psum(y, axis), COLLECTIVE_OUT)
    return y if b is None else y + b


def gather_sequence(x: jax.Array, axis: str | None, dim: int = -2) -> jax.Array:
    """All-gather the sequence ranges of `x[..., T / |axis|, D]` -> `x[..., T, D]` (in order).

    Not tagged for the remat policies: under `comms` the backward pass gathers again rather
    than keeping a full-length copy per layer (what sequence parallelism is for).
    """
    if axis is None:
        return x
    return jax.lax.all_gather(x, axis, axis=dim % x.ndim, tiled=True)


def position_rows(table: jax.Array, t: int, axis: str | None, sequence_parallel: bool):
    """The rows of the position table `table[T, D]` that this shard adds to a `t`-token
    sequence: `table[:t]`; sequence-parallel inside `shard_map`, this shard's range
    `[t / |axis|, D]`, which is the table's stored shard (sequence-parallel models split it
    over `axis` along T: logical axis `"positions"`), so no shard holds the whole table."""
    if not sequence_parallel or axis is None:
        return table[:t]
    if table.shape[0] * jax.lax.axis_size(axis) != t:
        raise ValueError(f"sequence-parallel positions need t = seq_len; got t={t}")
    return table


class VocabSlices(NamedTuple):
    """A token table used `count` slices of rows at a time (`memory.vocab_slices`): `rows` is
    this shard's table as stored, `prepare(slice)` turns one slice of it into what the math
    uses (the engine's RTS gather and cast), so the whole table never exists prepared at
    once, and in the backward pass each slice's gradient is reduce-scattered as it is made.
    The engine puts it where the model reads its table (`table[...]` returns it unchanged);
    the kernels below accept it wherever they accept a table."""

    rows: jax.Array
    count: int
    prepare: Callable[[jax.Array], jax.Array]

    def __getitem__(self, index) -> VocabSlices:  # `param[...]` in the model: the table itself
        if index is not Ellipsis:
            raise TypeError("a VocabSlices table is used whole by the vocabulary kernels")
        return self


def _vocab_range(table, axis: str | None) -> tuple[jax.Array | int, int]:
    """First vocabulary id held by this shard and the shard's size (`table[V_tensor, D]`)."""
    size = (table.rows if isinstance(table, VocabSlices) else table).shape[0]
    start = 0 if axis is None else jax.lax.axis_index(axis) * size
    return start, size


def _over_slices(fn: Callable, table, axis: str | None, empty=None):
    """`fn(rows, first_id)` on the whole table, or folded over the slices of a `VocabSlices`:
    `fn(rows, first_id, carry) -> carry` in a `lax.scan` from the carry `empty(shapes)`
    (default zeros), each slice a remat unit (prepared again in the backward pass)."""
    start, size = _vocab_range(table, axis)
    if not isinstance(table, VocabSlices):
        return fn(table, start)
    if table.count == 1:
        return fn(table.prepare(table.rows), start)
    n = size // table.count
    step = jax.checkpoint(lambda carry, b, j: fn(table.prepare(b), start + j * n, carry))
    slices = table.rows.reshape(table.count, n, *table.rows.shape[1:])  # rows: no copy
    first = jax.eval_shape(lambda b: fn(table.prepare(b), start), slices[0])
    zeros = lambda shapes: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    init = jax.tree.map(vary_like, (empty or zeros)(first), first)
    body = lambda carry, xs: (step(carry, *xs), None)
    return jax.lax.scan(body, init, (slices, jnp.arange(table.count)))[0]


def vocab_embed(
    tokens: jax.Array, table: jax.Array | VocabSlices, axis: str | None, scatter: bool = False
) -> jax.Array:
    """Vocab-parallel embedding: `tokens[..., T] int`, `table[V_tensor, D]` -> `x[..., T, D]`.

    Each shard looks up the ids in its vocabulary range (zeros elsewhere); a `psum` over
    `axis` assembles the full embedding. No shard ever holds the whole table. `scatter=True`
    (sequence parallelism) reduce-scatters over T instead: `-> x[..., T / |axis|, D]`.
    A `VocabSlices` table: the lookups of its slices, one after another, summed.
    """

    def lookup(rows, first, x=None):
        local = tokens - first
        inside = (local >= 0) & (local < rows.shape[0])
        found = jnp.take(rows, jnp.clip(local, 0, rows.shape[0] - 1), axis=0)
        found = jnp.where(inside[..., None], found, 0)
        return found if x is None else x + found

    if axis is None and not isinstance(table, VocabSlices):
        return jnp.take(table, tokens, axis=0)
    x = _over_slices(lookup, table, axis)
    if axis is None:
        return x
    if scatter:
        return jax.lax.psum_scatter(x, axis, scatter_dimension=x.ndim - 2, tiled=True)
    return jax.lax.psum(x, axis)


def vocab_cross_entropy(
    h: jax.Array, table: jax.Array | VocabSlices, targets: jax.Array, axis: str | None
) -> jax.Array:
    """Per-token cross-entropy of `logits = h @ table.T` without gathering the logits.

    Shapes: `h[..., D]`, `table[V_tensor, D]` (the tied embedding or the output projection),
    `targets[...]` int -> `loss[...]` float32. Each shard computes `logits[..., V_tensor]`;
    the softmax normaliser is assembled with a `pmax` and a `psum` of per-token scalars and
    the target logit with one more `psum`, so only `O(tokens)` numbers cross the wire.
    A `VocabSlices` table: the logits a slice of rows at a time, `[..., V_tensor / count]`,
    the normaliser accumulated online (a running max and the sum rescaled to it).
    """

    sliced = isinstance(table, VocabSlices) and table.count > 1

    def stats(rows, first, carry=None):
        """This slice's `(max, sum of exp(logit - max), target logit)`, merged into `carry`.
        Whole (not sliced), the max is the shards' (a `pmax`) and the target logit is taken
        relative to it."""
        logits = jnp.tensordot(h, rows, axes=((h.ndim - 1,), (1,))).astype(jnp.float32)
        # The max only stabilises exp(); it cancels in the loss, so no gradient flows through.
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        if axis is not None and not sliced:
            top = jax.lax.pmax(top, axis)
        z = logits - top[..., None]
        local = targets - first
        inside = (local >= 0) & (local < rows.shape[0])
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, rows.shape[0] - 1)[..., None], -1)
        picked = jnp.where(inside, picked[..., 0] + (top if sliced else 0.0), 0.0)
        out = (top, jnp.sum(jnp.exp(z), axis=-1), picked)
        return out if carry is None else _merge(carry, out)

    def empty(shapes):  # no logits yet: the lowest max, nothing summed or picked
        top, sum_exp, picked = (jnp.zeros(a.shape, a.dtype) for a in shapes)
        return top + jnp.finfo(top.dtype).min, sum_exp, picked

    top, sum_exp, picked = _over_slices(stats, table, axis, empty)
    if not sliced:
        if axis is not None:
            sum_exp, picked = jax.lax.psum((sum_exp, picked), axis)
        return jnp.log(sum_exp) - picked
    if axis is not None:  # each shard's sum rescaled to the shards' max
        shift = jax.lax.pmax(top, axis)
        sum_exp, picked = jax.lax.psum((sum_exp * jnp.exp(top - shift), picked), axis)
        top = shift
    return jnp.log(sum_exp) + top - picked


def _merge(a, b):
    """Two slices' `(max, sum of exp(logit - max), target logit)` -> the union's."""
    top = jnp.maximum(a[0], b[0])
    sum_exp = a[1] * jnp.exp(a[0] - top) + b[1] * jnp.exp(b[0] - top)
    return top, sum_exp, a[2] + b[2]

"""Data-parallel gradient reduction, for the inside of `shard_map`.

A parameter that is replicated over a mesh axis along which the *data* differs (`replica`
always; `pipeline` for parameters outside the layer stack, e.g. embeddings) gets a partial
gradient on each device. We mark such parameters as varying over those axes *once*, before
the loss (`vary_params`), so autodiff does not reduce inside the micro-batch loop; then
`reduce_grads` sums the partial gradients once per optimizer step: one `psum` per parameter
(the default), or fused into flat buckets of about `bucket_bytes` (fewer, larger collectives),
each reduced with `psum` or the `ppermute` ring of `jaxpod.parallel.collectives`.

The `tensor` axis is different: activations are identical across tensor shards, and the
Megatron kernels' own collectives already produce complete gradients there.

**Replicated tensor sharding** (`memory.rts = k`). The engine splits the replica axis into
`(replica, rts_outer, rts_inner)` (`jaxpod.parallel.mesh.split_replica`) so that k consecutive
replicas form a group along `rts` axes. Each weight is stored with one more dimension split
over the group (`rts_dims`, `with_rts`): a device holds 1/(t·p·k) of the weights. Inside
`shard_map` the engine calls `gather` right before use — for stacked layers inside the
layer scan, one layer at a time — an `all_gather` over the group; autodiff transposes it
into a `psum_scatter` (reduce-scatter), so each device receives the group's summed gradient
of just its own slice. Those axes are then no longer reduction axes of that weight (they
appear in its spec), and the remaining data-parallel sum runs as before.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpod.parallel.collectives import ring_all_reduce
from jaxpod.parallel.manual import varying_axes

DATA_AXES = ("replica", "pipeline")


def _spec_axes(spec: P) -> set[str]:
    names = set()
    for entry in spec:
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def reduction_axes(spec: P, data_axes: tuple[str, ...] = DATA_AXES) -> tuple[str, ...]:
    """Axes over which a parameter with this spec receives partial gradients."""
    return tuple(a for a in data_axes if a not in _spec_axes(spec))


def vary_params(params, specs, data_axes: tuple[str, ...] = DATA_AXES):
    """`pcast` each local parameter to varying over its reduction axes (no data moves)."""

    def varying(p, s):
        axes = reduction_axes(s, data_axes)
        return jax.lax.pcast(p, axes, to="varying") if axes else p

    return jax.tree.map(varying, params, specs)


ALLREDUCE = {"psum": jax.lax.psum, "ring": ring_all_reduce}  # = parallel.grad_allreduce


def reduce_grads(
    grads,
    specs,
    data_axes: tuple[str, ...] = DATA_AXES,
    *,
    allreduce: str = "psum",
    bucket_bytes: int = 0,
):
    """Sum each gradient over its reduction axes: the once-per-step data-parallel all-reduce.

    `allreduce` names the collective (`ALLREDUCE`); `bucket_bytes=0` reduces each leaf on its
    own, otherwise leaves that share reduction axes, dtype and varying axes are concatenated
    (flattened, in tree order) into buckets of at most `bucket_bytes` (a bigger leaf is a
    bucket alone), one collective each, and split back. Every gradient is ready only after
    the whole backward pass here, so the order of the buckets does not matter."""
    reduce = ALLREDUCE[allreduce]
    flat, tree = jax.tree.flatten(grads)
    axes = [reduction_axes(s, data_axes) for s in tree.flatten_up_to(specs)]
    keys = [(a, g.dtype, varying_axes(g)) if a else None for a, g in zip(axes, flat, strict=True)]
    sizes = [g.size * g.dtype.itemsize for g in flat]
    out = list(flat)
    for bucket in group_into_buckets(sizes, keys, bucket_bytes):
        parts = [flat[i] for i in bucket]
        if len(parts) == 1:
            out[bucket[0]] = reduce(parts[0], axes[bucket[0]])
            continue
        summed = reduce(jnp.concatenate([p.reshape(-1) for p in parts]), axes[bucket[0]])
        ends = list(itertools.accumulate(p.size for p in parts))
        for i, p, piece in zip(bucket, parts, jnp.split(summed, ends[:-1]), strict=True):
            out[i] = piece.reshape(p.shape)
    return tree.unflatten(out)


def group_into_buckets(sizes: list[int], keys: list, bucket_bytes: int) -> list[list[int]]:
    """Leaf indices grouped into buckets, in order of their first leaf: leaves with equal
    `keys` (None: not reduced, in no bucket) fill a bucket in order while its `sizes` sum
    to at most `bucket_bytes`; 0 puts every leaf in a bucket of its own."""
    buckets: list[list[int]] = []
    open_bucket: dict = {}  # key -> (index into buckets, bytes so far)
    for i, (size, key) in enumerate(zip(sizes, keys, strict=True)):
        if key is None:
            continue
        if key in open_bucket and open_bucket[key][1] + size <= bucket_bytes:
            b, used = open_bucket[key]
            buckets[b].append(i)
            open_bucket[key] = (b, used + size)
            continue
        buckets.append([i])
        open_bucket[key] = (len(buckets) - 1, size)
    return buckets


NO_GATHER = -1  # the RTS dimension of a leaf that is not split over the RTS group


def rts_dims(shapes, specs, stacked, mesh_shape, axes: tuple[str, ...], avoid=None):
    """Per leaf, the dimension to split over the mesh `axes` (product k), or `NO_GATHER`.

    The chosen dimension is the one with the largest local size (after its existing split)
    that k divides; the leading layer dimension of stacked leaves (`stacked` True) is never
    chosen, so the layer scan can slice layers and gather one at a time, nor a dimension in
    the leaf's `avoid` entry (a tuple of dimensions; `avoid=None`: none), e.g. the one a
    panel is cut along before the gather.
    """
    k = math.prod(mesh_shape[a] for a in axes)
    if avoid is None:
        avoid = jax.tree.map(lambda _: (), stacked)

    def best_dim(shape, spec, is_stacked, avoided):
        if k == 1:
            return NO_GATHER
        entries = tuple(spec) + (None,) * (len(shape.shape) - len(spec))
        best, best_size = NO_GATHER, 0
        for d, (n, entry) in enumerate(zip(shape.shape, entries, strict=True)):
            local = n // math.prod(mesh_shape[a] for a in _spec_axes(P(entry)) - {None})
            allowed = (d > 0 or not is_stacked) and d not in avoided
            if allowed and local % k == 0 and local > best_size:
                best, best_size = d, local
        return best

    is_spec = lambda x: isinstance(x, P)
    return jax.tree.map(best_dim, shapes, specs, stacked, avoid, is_leaf=is_spec)


def with_rts(specs, dims, axes: tuple[str, ...]):
    """`specs` with `axes` appended (as the minor split) to each leaf's RTS dimension."""

    def split(spec, dim):
        if dim == NO_GATHER:
            return spec
        entries = list(spec) + [None] * (dim + 1 - len(spec))
        old = entries[dim]
        old = () if old is None else old if isinstance(old, tuple) else (old,)
        entries[dim] = (*old, *axes)
        return P(*entries)

    return jax.tree.map(split, specs, dims, is_leaf=lambda x: isinstance(x, P))


def gather(tree, dims, axes: tuple[str, ...], leading: int = 0, panels=None):
    """Inside `shard_map`: all-gather each leaf over `axes` along its RTS dimension (`dims`,
    shifted by `leading` for slices of stacked leaves). `tree` may hold a subset of `dims`'s
    entries (one step's matrices of a layer). `panels` (same structure as `tree`, entries a
    `jaxpod.models.layers.Panel` or None) asks for one panel of a leaf along a dimension of
    the gathered array: cut from the local shard before the gather when the gathered
    dimension is another one (only the panel is gathered), after it otherwise. Its
    transpose, in the backward pass, is the reduce-scatter of the gradients."""
    if not axes:
        return take_panels(tree, panels)
    if panels is None:
        panels = jax.tree.map(lambda _: None, tree)
    gathered = lambda x, d: jax.lax.all_gather(x, axes, axis=d, tiled=True)
    take = lambda x, p: take_panel(x, p.axis, p.index, p.count)

    def prepared(x, dim, panel):
        if dim == NO_GATHER:
            return x if panel is None else take(x, panel)
        d = dim - leading
        if panel is None:
            return gathered(x, d)
        if panel.axis == d:
            return take(gathered(x, d), panel)
        return gathered(take(x, panel), d)

    is_leaf = lambda x: x is None
    return jax.tree.map(prepared, tree, _like(dims, tree), panels, is_leaf=is_leaf)


def take_panels(tree, panels=None):
    """`take_panel` of each leaf of `tree` with a `Panel` in `panels` (same structure as
    `tree`, entries a `jaxpod.models.layers.Panel` or None; `panels=None`: `tree` whole)."""
    if panels is None:
        return tree
    take = lambda a, p: a if p is None else take_panel(a, p.axis, p.index, p.count)
    return jax.tree.map(take, tree, panels, is_leaf=lambda x: x is None)


def take_panel(a: jax.Array, axis: int, index, count: int) -> jax.Array:
    """Panel `index` (an int, or a traced index inside a loop) of `count` equal panels of `a`
    along `axis`."""
    n = a.shape[axis] // count
    if isinstance(index, int):
        return jax.lax.slice_in_dim(a, index * n, (index + 1) * n, axis=axis)
    return jax.lax.dynamic_slice_in_dim(a, index * n, n, axis=axis)


def _like(dims, tree):
    """The entries of the nested-dict `dims` that `tree` (a subset of its keys) has."""
    if isinstance(tree, dict) and isinstance(dims, dict):
        return {k: _like(dims[k], v) for k, v in tree.items()}
    return dims

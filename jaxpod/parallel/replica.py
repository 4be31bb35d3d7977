"""Data-parallel gradient reduction, for the inside of `shard_map`.

A parameter that is replicated over a mesh axis along which the *data* differs (`replica`
always; `pipeline` for parameters outside the layer stack, e.g. embeddings) gets a partial
gradient on each device. We mark such parameters as varying over those axes *once*, before
the loss (`vary_params`), so autodiff does not reduce inside the micro-batch loop; then
`reduce_grads` sums the partial gradients with one `psum` per parameter per optimizer step.

The `tensor` axis is different: activations are identical across tensor shards, and the
Megatron kernels' own collectives already produce complete gradients there.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

DATA_AXES = ("replica", "pipeline")


def _spec_axes(spec: P) -> set[str]:
    names = set()
    for entry in spec:
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def reduction_axes(spec: P) -> tuple[str, ...]:
    """Axes over which a parameter with this spec receives partial gradients."""
    return tuple(a for a in DATA_AXES if a not in _spec_axes(spec))


def _map(fn, tree, specs):
    return jax.tree.map(fn, tree, specs, is_leaf=lambda x: isinstance(x, P))


def vary_params(params, specs):
    """`pcast` each local parameter to varying over its reduction axes (no data moves)."""
    return jax.tree.map(
        lambda p, s: jax.lax.pcast(p, reduction_axes(s), to="varying") if reduction_axes(s) else p,
        params,
        specs,
    )


def reduce_grads(grads, specs):
    """Sum each gradient over its reduction axes: the once-per-step data-parallel all-reduce."""
    return jax.tree.map(
        lambda g, s: jax.lax.psum(g, reduction_axes(s)) if reduction_axes(s) else g, grads, specs
    )

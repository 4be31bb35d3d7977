"""A stage's part of the layer stack inside `shard_map`: the plain scan, and the options
composed around it.

The plain path is `scan_layers(layer, x, stacked)`: one `lax.scan`, each layer one remat unit.
Each memory option wraps a piece of it, in its own module:

    weights made ready   weights_ready.py   fetch, RTS all-gather and cast, right before use
    matrix streaming     matrix_stream.py   a layer run as steps, one matrix (panel) at a time
    phases               phases.py          K scans, each fetching its own weights
    activation offload   remat.py           the policy's saved values in host memory
    virtual stages       here               one of V equal parts of the stack (circular)

The caller supplies `prepare` (stored -> computed weights) and `fetch` (host -> device); the
model stays math and never sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.parallel.matrix_stream import matrix_layer
from jaxpod.parallel.offload import is_resting
from jaxpod.parallel.phases import scan_phases
from jaxpod.parallel.remat import remat, saving
from jaxpod.parallel.weight_split import SAVED, StageSplit
from jaxpod.parallel.weights_ready import make_ready

STREAMS = ("layer", "matrix")
cp = jax.checkpoint_policies


class StackOptions(NamedTuple):
    """How a stage runs its layers, fixed per engine: the `remat_policy` of each layer;
    `phases` (K scans); `stream` (`"layer"`: a layer's weights made ready before it runs;
    `"matrix"`: each of its steps' weights, `mlp_panels` panels for the MLP);
    `offload_activations` (the policy's saved values in host memory); `unroll` (the layer
    scan unrolled: FLOP accounting only); `layer_loop` (each layer traced in turn, no layer
    scan: a forward-only pipeline table's tick scan, transposed by autodiff, stacks what
    each tick saves, and XLA:TPU's host offloading takes a saved value stacked once, over
    the ticks, but not twice, over the ticks and the layers: docs/memory.md)."""

    remat_policy: str = "none"
    phases: int = 1
    stream: str = "layer"
    mlp_panels: int = 1
    offload_activations: bool = False
    unroll: bool = False
    layer_loop: bool = False


def run_stack(
    layers: nnx.Module,
    x: jax.Array,
    *,
    tp: str | None,
    options: StackOptions,
    prepare: Callable | None = None,
    fetch: Callable | None = None,
    fetch_whole: dict | None = None,
    virtual_stage: tuple[jax.Array | int, int] | None = None,
) -> jax.Array:
    """Run a stacked layer module (`[L, ...]` params, called as `layer(x, tp)`) over
    `x[B, T, D]`, one layer at a time, as `options` say.

    `prepare(params, panels)` turns stored params into computed ones right before use
    (`panels`: the `Panel` to take of each leaf, or None). `fetch` (host -> device memory):
    with `stream="layer"` per phase (`scan_phases`); with `stream="matrix"` per step, the
    matrices the step reads and nothing else, each one layer's slice of the whole stack,
    inside the step's remat unit (fetched again in the backward pass; `prepare` then takes
    the panels on the device, so its gather must not split a panel axis). The leaves marked
    in `fetch_whole` (a tree of bools like the stack's params: the engine marks its biases
    and norms, a few vectors a layer) are fetched whole once, before the layers run: XLA:TPU
    lays out a stacked bias such as `b_qkv[L, 3, HD]` in host memory with the layer axis
    inside its tiles and cannot read a slice of that axis from the host.
    `virtual_stage=(r, V)`: only the layers of the r-th of V virtual stages (r may be
    traced)."""
    if options.stream not in STREAMS:
        raise ValueError(f"stream={options.stream!r} must be one of {STREAMS}")
    graphdef, stacked = nnx.split(layers)
    policy = options.remat_policy
    step_fetch = options.stream == "matrix" and fetch is not None
    if options.stream == "matrix":
        ready = make_ready(prepare, fetch, policy)
        layer = matrix_layer(graphdef, tp, ready, policy, options.mlp_panels)
        phase_fetch = None  # each step fetches its own
    else:
        ready = make_ready(prepare, None, policy)
        layer = lambda x, p: nnx.merge(graphdef, ready(p, x))(x, tp)  # noqa: E731
        phase_fetch = fetch
    # the layer is the outer remat unit either way: only its input is saved per layer (and
    # per pipeline tick); the steps' inputs live only while that layer's backward pass runs
    layer_fn = remat(layer, policy, offload=options.offload_activations)
    stacked = nnx.to_pure_dict(stacked)
    if fetch is not None and fetch_whole is not None:  # fetched once, before the layers run
        whole = lambda a, w: fetch(a) if w else a  # noqa: E731
        stacked = jax.tree.map(whole, stacked, fetch_whole, is_leaf=is_resting)
    if step_fetch or (virtual_stage is not None and options.phases == 1 and phase_fetch is None):
        return _scan_indexed(layer, x, stacked, virtual_stage, options, whole=step_fetch)
    if virtual_stage is not None:
        stacked = virtual_stage_slice(stacked, virtual_stage)
    return scan_phases(
        layer_fn,
        x,
        stacked,
        unroll=options.unroll,
        loop=options.layer_loop,
        phases=options.phases,
        fetch=phase_fetch,
        remat_policy=policy,
    )


def split_stack(
    layers: nnx.Module,
    *,
    tp: str | None,
    options: StackOptions,
    prepare: Callable | None,
    stack_of: Callable,
) -> StageSplit | None:
    """The stage's layers as B and W split them (`StageSplit`): each layer made ready like
    `run_stack`'s (`prepare`) under the remat policy, its params `stack_of(p, r)`; None
    where a layer runs as steps (`stream="matrix"`: the split is per layer). Its one scan
    stands for `phases` too: the split kinds' stage reads weights already on the device."""
    if options.stream != "layer":
        return None
    graphdef = nnx.split(layers)[0]
    ready = make_ready(prepare, None, options.remat_policy)
    layer = lambda x, p: nnx.merge(graphdef, ready(p, x))(x, tp)  # noqa: E731
    policy, offload = options.remat_policy, options.offload_activations
    if policy == "none" or offload:
        remat_fn = lambda fn: remat(fn, policy, offload=offload)  # noqa: E731
    else:  # B's own recomputation skips the weights' matmuls (`SAVED`: kept for W anyway)
        saves = cp.save_from_both_policies(saving(policy), cp.save_only_these_names(SAVED))
        remat_fn = lambda fn: jax.checkpoint(fn, policy=saves)  # noqa: E731
    return StageSplit(layer, stack_of, remat_fn, options.unroll)


def virtual_stage_slice(stacked: dict, virtual_stage: tuple) -> dict:
    """The `[L/V, ...]` layers of virtual stage r of V (`virtual_stage=(r, V)`)."""
    index, count = virtual_stage
    size = jax.tree.leaves(stacked)[0].shape[0] // count
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, index * size, size, 0)  # noqa: E731
    return jax.tree.map(take, stacked)


def _scan_indexed(layer, x, stacked: dict, virtual_stage, options: StackOptions, whole: bool):
    """The layers (of virtual stage r of V, `virtual_stage=(r, V)`; None: all), each indexed
    inside its remat unit: the backward pass indexes it again, instead of every tick saving
    its stage's layers. `whole` (each step fetches its own weights): the layer gets the whole
    stack and its index, and each step reads its own slice of it inside its own remat unit,
    so a host-resident array is never saved, carried or sliced anywhere else (phases change
    nothing: each step fetches)."""
    offset, size = 0, jax.tree.leaves(stacked)[0].shape[0]
    if virtual_stage is not None:
        index, count = virtual_stage
        size //= count
        offset = index * size

    def run(x, i):
        if whole:
            return layer(x, stacked, offset + i)
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, offset + i, 0, False)  # noqa: E731
        return layer(x, jax.tree.map(pick, stacked))

    at = remat(run, options.remat_policy, offload=options.offload_activations)
    if options.layer_loop:
        for i in range(size):
            x = at(x, i)
        return x
    body = lambda x, i: (at(x, i), None)  # noqa: E731
    return jax.lax.scan(body, x, jnp.arange(size), unroll=options.unroll)[0]

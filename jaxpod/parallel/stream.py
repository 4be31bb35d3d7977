"""Running a stack of transformer blocks: the layer scan, phases, and streaming.

`apply_stack` runs a stacked `jaxpod.models.layers.Block` (`[L, ...]` params) one layer at a
time, each layer a remat unit: with `stream="layer"` a layer's weights are prepared (the
engine's hook: cast, RTS all-gather) right before the layer runs; with `stream="matrix"` the
layer runs as `Block.steps`, one weight matrix (or one block of one) prepared at a time.
`scan_layers` is the scan over the layers, cut into phases that each fetch their weights
(e.g. from host memory); with `stream="matrix"` each step fetches its own blocks instead.
`tie` keeps a layer's prepared weights a function of its input, so XLA cannot hoist their
gather out of the pipeline's tick loop.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpod.models.layers import BLOCK_AXES, Block, Slice
from jaxpod.parallel.remat import remat
from jaxpod.parallel.replica import take_blocks

# Weights a phase fetched (see `scan_layers`): never saved for the backward pass, fetched again.
PHASE_WEIGHTS = "phase_weights"


def scan_layers(
    layer_fn: Callable,
    x: jax.Array,
    stacked: dict,
    *,
    unroll: bool = False,
    phases: int = 1,
    fetch: Callable | None = None,
) -> jax.Array:
    """Apply `layer_fn(x, one_layer_params) -> x` to every layer of `stacked` (`[L, ...]`).

    One `lax.scan` over the layers; with `phases=K` the stack is cut into K contiguous
    phases of L/K layers, each its own scan, and `fetch` (if given) is applied to a phase's
    `[L/K, ...]` weights right before that phase runs (the caller's hook: e.g. moving them
    from host to device memory). A fetching phase is a `jax.checkpoint` that saves everything
    but the fetched weights (`PHASE_WEIGHTS`): the backward pass fetches each phase's weights
    again instead of keeping every phase's copy alive. Math only: the result does not
    depend on K.
    """
    if phases == 1 and fetch is None:
        return jax.lax.scan(lambda c, p: (layer_fn(c, p), None), x, stacked, unroll=unroll)[0]
    size = jax.tree.leaves(stacked)[0].shape[0]
    if size % phases:
        raise ValueError(f"{size} layers do not split into phases={phases}")
    n = size // phases

    def phase(x, chunk):
        if fetch is not None:
            chunk = jax.tree.map(lambda a: checkpoint_name(a, PHASE_WEIGHTS), fetch(chunk))
        return jax.lax.scan(lambda c, p: (layer_fn(c, p), None), x, chunk, unroll=unroll)[0]

    if fetch is not None:
        keep = jax.checkpoint_policies.save_anything_except_these_names(PHASE_WEIGHTS)
        phase = jax.checkpoint(phase, policy=keep, prevent_cse=False)
    for i in range(phases):
        x = phase(x, jax.tree.map(lambda a, i=i: a[i * n : (i + 1) * n], stacked))
    return x


def tie(weights, x: jax.Array):
    """`weights` unchanged (`w + 0 * x[0]`), but now a function of `x`, so what `prepare`
    does with them next (the RTS all-gather, the cast to the compute dtype) can only run
    once this layer's input exists: per layer *and per pipeline tick*, one layer's gathered
    weights alive at a time. Untied, the weights of a stage are the same on every GPipe
    tick, so XLA hoists their gather out of the tick loop and holds the whole stage gathered
    (30.6 -> 22.5 MB on the 4x2x1 RTS-4 planner case), and a scheduler is free to start
    every phase's gather at once. An `optimization_barrier` stops the hoisting but not the
    scheduler (XLA drops barriers before scheduling: GPT-3 POD256 12.2 GB of temporaries,
    7.6 GB with this tie; docs/benchmarks.md). A leaf whose varying axes do not cover `x`'s
    is left untied (the sum would widen its type)."""
    token = x.reshape(-1)[0]
    vma = lambda a: getattr(jax.typeof(a), "vma", frozenset())
    zero = jnp.nan_to_num(token) * 0  # finite, so the sum is exact

    def one(w):
        if not vma(token) <= vma(w):
            return w
        return w + zero.astype(w.dtype)

    return jax.tree.map(one, weights)


def _select(tree: dict, reads: tuple[str | Slice, ...]) -> tuple[dict, dict]:
    """The entries of the nested dict `tree` named by `reads` (paths like `"attn/w_o"`, or
    `Slice`s), and a dict of the same structure holding each entry's `Slice` (or None)."""
    out: dict = {}
    blocks: dict = {}
    for read in reads:
        path, block = (read.path, read) if isinstance(read, Slice) else (read, None)
        *parents, leaf = path.split("/")
        src, dst, bdst = tree, out, blocks
        for key in parents:
            src, dst, bdst = src[key], dst.setdefault(key, {}), bdst.setdefault(key, {})
        dst[leaf] = src[leaf]
        bdst[leaf] = jax.tree.map(lambda _, b=block: b, src[leaf])
    return out, blocks


def _overlay(base: dict, top: dict) -> dict:
    """`base` with the entries of `top` (a `_select` of it) replaced."""
    return {
        k: (_overlay(v, top[k]) if isinstance(v, dict) else top[k]) if k in top else v
        for k, v in base.items()
    }


def apply_stack(
    blocks: Block,
    remat_policy: str,
    x: jax.Array,
    tp: str | None = None,
    unroll: bool = False,
    *,
    phases: int = 1,
    fetch: Callable | None = None,
    prepare: Callable | None = None,
    offload_activations: bool = False,
    stream: str = "layer",
    mlp_blocks: int = 1,
) -> jax.Array:
    """Run a stacked `Block` (`[L, ...]` params) over `x[B, T, D]`, one layer at a time.

    `prepare(params, blocks)` is applied to the params right before they are used (the
    engine's hook, e.g. gathering replicated-tensor-sharded weights; `blocks`: `_select`'s,
    the `Slice` to take of each leaf, or None): with `stream="layer"` to each layer's
    params before the layer runs, the layer being one remat unit; with `stream="matrix"` to
    the params of each of the layer's steps (`Block.steps`: at most one weight matrix, or
    one of `mlp_blocks` blocks of the MLP's, each; a step reading `Slice(index=None)` runs
    once per block, the first block and then a `lax.scan` over the others, so one block is
    gathered at a time and the blocks' gradients add into one buffer) before that step
    runs, each step a remat unit nested in the layer's, so one matrix is prepared (and its
    gradient reduce-scattered) at a time, forward and backward: the backward pass
    recomputes the layer (saving the steps' inputs, for this layer only), then each step
    again (gathering its matrix again).

    `fetch` (e.g. host -> device memory): with `stream="layer"` applied per phase (see
    `scan_layers`, `phases`); with `stream="matrix"` per step, to the blocks the step reads
    and nothing else, inside the step's remat unit (fetched again in the backward pass). The
    blocks are then taken before `prepare` sees them (`blocks` None), so its gather must not
    split a `BLOCK_AXES` axis. `offload_activations`: the remat policy's saved values go to
    host memory (`jaxpod.parallel.remat`). `unroll=True` unrolls the layer scan (FLOPs only).
    """
    if stream not in ("layer", "matrix"):
        raise ValueError(f"stream={stream!r} must be 'layer' or 'matrix'")
    graphdef, stacked = nnx.split(blocks)

    step_fetch = fetch is not None and stream == "matrix"

    def ready(params, x, blocks=None):  # stored params -> what the computation uses
        if step_fetch:  # this step's weights only: its blocks taken, then fetched
            params, blocks = fetch(take_blocks(params, blocks)), None
        if prepare is None:
            return take_blocks(params, blocks)
        if remat_policy != "none":  # recomputed in the backward pass: gather it per tick
            params = tie(params, x)
        return prepare(params, blocks)

    def one_layer(x, layer_params):
        return nnx.merge(graphdef, ready(layer_params, x))(x, tp)

    def run(step, carry, used, blocks, layer_params):  # one step of a layer, a remat unit
        def fn(carry, used):
            block = nnx.merge(graphdef, _overlay(layer_params, ready(used, carry[0], blocks)))
            return step(block, carry)

        return remat(fn, remat_policy, prevent_cse=True)(carry, used)

    def looped(step, carry, used, blocks, layer_params):  # reads `Slice(index=None)`: per block
        leaves, tree = jax.tree.flatten(used)
        cuts = tree.flatten_up_to(blocks)
        count = next(b.count for b in cuts if b is not None and b.index is None)
        if not step_fetch:  # the block index traced: taken of the stored weights in the step
            index = lambda b, j: b if b is None or b.index is not None else b._replace(index=j)
            at = lambda j: tree.unflatten([index(b, j) for b in cuts])
            one = lambda c, j: run(step, c, used, at(j), layer_params)
            first, rest = 0, jnp.arange(1, count)
        else:
            # Fetched per step (host-resident weights): the blocks are cut before the loop and
            # the loop runs over them (its xs), each fetched inside its step (a traced slice of
            # host memory would need its gradient summed in host memory, which jax 0.10.2
            # rejects). The other leaves (LayerNorm) are fetched once here, for every block.
            is_cut = [b is not None and b.index is None for b in cuts]
            cut = zip(leaves, cuts, is_cut, strict=True)
            pieces = [_split(a, b.axis, count) for a, b, is_block in cut if is_block]
            fixed = fetch([a for a, is_block in zip(leaves, is_cut, strict=True) if not is_block])

            def one(c, piece):
                blocks, others = iter(piece), iter(fixed)
                used = [next(blocks) if is_block else next(others) for is_block in is_cut]
                return run(step, c, tree.unflatten(used), None, layer_params)

            first, rest = [p[0] for p in pieces], [p[1:] for p in pieces]
        carry = one(carry, first)
        if count > 1:  # the other blocks in a loop: one block's weights gathered at a time,
            # their gradients summed into one buffer. The step's input carry[0] passes through
            # unchanged: closed over, not carried, so the loop saves it once for the backward
            # pass instead of once per block (only the accumulated sums are carried)
            x = carry[0]
            body = lambda acc, j: (one((x, *acc), j)[1:], None)
            carry = (x, *jax.lax.scan(body, carry[1:], rest)[0])
        return carry

    def matrix_by_matrix(x, layer_params):
        carry = (x,)
        for reads, step in nnx.merge(graphdef, layer_params).steps(tp, mlp_blocks):
            used, blocks = _select(layer_params, reads)
            if any(isinstance(r, Slice) and r.index is None for r in reads):
                carry = looped(step, carry, used, blocks, layer_params)
            else:
                carry = run(step, carry, used, blocks, layer_params)
        return carry[0]

    # the layer is the outer remat unit either way: only its input is saved per layer (and per
    # pipeline tick); the steps' inputs live only while that layer's backward pass runs
    layer = matrix_by_matrix if stream == "matrix" else one_layer
    layer_fn = remat(layer, remat_policy, offload=offload_activations)
    stacked = nnx.to_pure_dict(stacked)
    phase_fetch = None if step_fetch else fetch
    return scan_layers(layer_fn, x, stacked, unroll=unroll, phases=phases, fetch=phase_fetch)


def block_axes(stacked: dict) -> dict:
    """Per leaf of a stacked block's params (`[L, ...]`), the dimensions `Block.steps` takes
    blocks along (`BLOCK_AXES`, shifted by the layer dimension): `(d,)` or `()`."""

    def one(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return (BLOCK_AXES[name] + 1,) if name in BLOCK_AXES else ()

    return jax.tree_util.tree_map_with_path(one, stacked)


def _split(a: jax.Array, axis: int, count: int) -> jax.Array:
    """`a` cut into `count` equal blocks along `axis`, stacked: `[count, ...]`."""
    shape = (*a.shape[:axis], count, a.shape[axis] // count, *a.shape[axis + 1 :])
    return jnp.moveaxis(a.reshape(shape), axis, 0)

"""Running a stacked layer (`[L, ...]` params) inside `shard_map`: the layer scan, phases, and
streaming a layer matrix by matrix.

`run_stack` runs a stacked `jaxpod.models.layers.Layer` one layer at a time, each layer a
remat unit. The caller's `prepare` turns stored weights into computed ones (the RTS
all-gather, the cast to the compute dtype) right before use; its `fetch` moves them from host
memory. With `stream="layer"` a layer's weights are prepared before it runs and phases fetch
their layers; with `stream="matrix"` the layer runs as `Layer.steps`, one weight matrix (or
one panel of one) prepared, and fetched, at a time. The model stays math: it never sees
these hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpod.models.layers import Panel, scan_layers
from jaxpod.parallel.remat import REMAT_POLICIES, remat
from jaxpod.parallel.replica import take_panels

# Weights a phase fetched (see `scan_phases`): never saved for the backward pass, fetched again.
PHASE_WEIGHTS = "phase_weights"
# A layer's input inside a fetching phase: what the phase saves per layer under remat.
LAYER_INPUT = "phase_layer_input"
STREAMS = ("layer", "matrix")


def scan_phases(
    layer_fn: Callable,
    x: jax.Array,
    stacked: dict,
    *,
    unroll: bool = False,
    phases: int = 1,
    fetch: Callable | None = None,
    remat_policy: str = "none",
) -> jax.Array:
    """Apply `layer_fn(x, one_layer_params) -> x` to every layer of `stacked` (`[L, ...]`).

    With `phases=K` the stack is cut into K contiguous phases of L/K layers, each its own
    scan, and `fetch` (if given) is applied to a phase's `[L/K, ...]` weights right before
    that phase runs (e.g. host to device memory). A fetching phase is a `jax.checkpoint`
    that keeps what the layers' `remat_policy` keeps (each layer's input and the policy's
    values; with `none`, everything) but never the fetched weights (`PHASE_WEIGHTS`): the
    backward pass fetches each phase's weights again instead of keeping every phase's copy
    alive. (An outer policy overrides the inner one: "save anything" here would save every
    layer's intermediates whatever the layer's policy.) The result does not depend on K.
    """
    if phases == 1 and fetch is None:
        return scan_layers(layer_fn, x, stacked, unroll)
    size = jax.tree.leaves(stacked)[0].shape[0]
    if size % phases:
        raise ValueError(f"{size} layers do not split into phases={phases}")
    n = size // phases
    step = layer_fn
    if fetch is not None and remat_policy != "none":
        step = lambda x, p: layer_fn(checkpoint_name(x, LAYER_INPUT), p)  # noqa: E731

    def phase(x, phase_layers):
        if fetch is not None:
            fetched = fetch(phase_layers)
            phase_layers = jax.tree.map(lambda a: checkpoint_name(a, PHASE_WEIGHTS), fetched)
        return scan_layers(step, x, phase_layers, unroll)

    if fetch is not None:
        phase = jax.checkpoint(phase, policy=phase_policy(remat_policy), prevent_cse=False)
    for i in range(phases):
        x = phase(x, jax.tree.map(lambda a, i=i: a[i * n : (i + 1) * n], stacked))
    return x


def phase_policy(remat_policy: str) -> Callable:
    """What a fetching phase saves for the backward pass: with `none` everything but the
    fetched weights; otherwise each layer's input (`LAYER_INPUT`) and what the layer's
    policy saves, as the same layers scanned without phases would."""
    cp = jax.checkpoint_policies
    if remat_policy == "none":
        return cp.save_anything_except_these_names(PHASE_WEIGHTS)
    inputs = cp.save_only_these_names(LAYER_INPUT)
    return cp.save_from_both_policies(inputs, REMAT_POLICIES[remat_policy])


def depend_on(weights, x: jax.Array):
    """`weights` unchanged (`w + 0 * x[0]`), but now a function of `x`, so what `prepare`
    does with them next (the RTS all-gather, the cast) can only run once this layer's input
    exists: per layer *and per pipeline tick*, one layer's gathered weights alive at a time.
    Otherwise a stage's weights are the same on every GPipe tick, XLA hoists their gather out
    of the tick loop and holds the whole stage gathered, and a scheduler may start every
    phase's gather at once (an `optimization_barrier` stops the hoisting but not the
    scheduler). A leaf whose varying axes do not cover `x`'s is left
    alone (the sum would widen its type)."""
    token = x.reshape(-1)[0]
    vma = lambda a: getattr(jax.typeof(a), "vma", frozenset())
    zero = jnp.nan_to_num(token) * 0  # finite, so the sum is exact

    def depending_on_x(w):
        return w + zero.astype(w.dtype) if vma(token) <= vma(w) else w

    return jax.tree.map(depending_on_x, weights)


def _select(tree: dict, reads: tuple[str | Panel, ...]) -> tuple[dict, dict]:
    """The entries of the nested dict `tree` named by `reads` (paths like `"attn/w_o"`, or
    `Panel`s), and a dict of the same structure holding each entry's `Panel` (or None)."""
    out: dict = {}
    panels: dict = {}
    for read in reads:
        path, panel = (read.path, read) if isinstance(read, Panel) else (read, None)
        *parents, leaf = path.split("/")
        src, dst, pdst = tree, out, panels
        for key in parents:
            src, dst, pdst = src[key], dst.setdefault(key, {}), pdst.setdefault(key, {})
        dst[leaf] = src[leaf]
        pdst[leaf] = jax.tree.map(lambda _, p=panel: p, src[leaf])
    return out, panels


def _overlay(base: dict, top: dict) -> dict:
    """`base` with the entries of `top` (a `_select` of it) replaced."""
    return {
        k: (_overlay(v, top[k]) if isinstance(v, dict) else top[k]) if k in top else v
        for k, v in base.items()
    }


def run_stack(
    layers: nnx.Module,
    x: jax.Array,
    *,
    tp: str | None,
    remat_policy: str,
    prepare: Callable | None = None,
    fetch: Callable | None = None,
    phases: int = 1,
    stream: str = "layer",
    mlp_panels: int = 1,
    offload_activations: bool = False,
    unroll: bool = False,
    virtual_stage: tuple[jax.Array | int, int] | None = None,
) -> jax.Array:
    """Run a stacked `Layer` (`[L, ...]` params) over `x[B, T, D]`, one layer at a time;
    `virtual_stage=(r, V)`: only the layers of the r-th of V virtual stages, an equal part of
    the stack each (r may be traced).

    `prepare(params, panels)` turns stored params into computed ones right before use
    (`panels`: the `Panel` to take of each leaf, or None): with `stream="layer"` a layer's
    params before the layer runs, the layer one remat unit; with `stream="matrix"` the
    params of each of the layer's steps (`Layer.steps`: one weight matrix, or one of
    `mlp_panels` panels of the MLP's; a step reading `Panel(index=None)` runs once per panel,
    the first and then a `lax.scan` over the others, so one panel is gathered at a time and
    their gradients add into one buffer), each step a remat unit nested in the layer's: the
    backward pass recomputes the layer, then each step again (gathering its matrix again).

    `fetch` (e.g. host -> device memory): with `stream="layer"` per phase (`scan_phases`);
    with `stream="matrix"` per step, to the panels the step reads and nothing else, inside the
    step's remat unit (fetched again in the backward pass). The panels are then taken before
    `prepare` sees them (`panels` None), so its gather must not split a panel axis (`masks.panel`).
    `offload_activations`: the remat policy's saved values go to host memory. `unroll=True`
    unrolls the layer scan (FLOP accounting only).
    """
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r} must be one of {STREAMS}")
    graphdef, stacked = nnx.split(layers)
    step_fetch = fetch is not None and stream == "matrix"

    def ready(params, x, panels=None):  # stored params -> what the computation uses
        if step_fetch:  # this step's weights only: its panels taken, then fetched
            params, panels = fetch(take_panels(params, panels)), None
        if prepare is None:
            return take_panels(params, panels)
        if remat_policy != "none":  # recomputed in the backward pass: gather it per tick
            params = depend_on(params, x)
        return prepare(params, panels)

    def whole_layer(x, layer_params):
        return nnx.merge(graphdef, ready(layer_params, x))(x, tp)

    def run_step(step, carry, used, panels, layer_params):  # one step of a layer, a remat unit
        def fn(carry, used):
            layer = nnx.merge(graphdef, _overlay(layer_params, ready(used, carry[0], panels)))
            return step(layer, carry)

        return remat(fn, remat_policy, prevent_cse=True)(carry, used)

    def per_panel(step, carry, used, panels, layer_params):  # reads `Panel(index=None)`
        leaves, tree = jax.tree.flatten(used)
        cuts = tree.flatten_up_to(panels)
        count = next(p.count for p in cuts if p is not None and p.index is None)
        if not step_fetch:  # the panel index traced: taken of the stored weights in the step
            index = lambda p, j: p if p is None or p.index is not None else p._replace(index=j)
            at = lambda j: tree.unflatten([index(p, j) for p in cuts])
            run_panel = lambda c, j: run_step(step, c, used, at(j), layer_params)
            first, rest = 0, jnp.arange(1, count)
        else:
            # Fetched per step (host-resident weights): the panels are cut before the loop and
            # the loop runs over them (its xs), each fetched inside its step (a traced slice of
            # host memory would need its gradient summed in host memory, which jax
            # rejects). The other leaves (LayerNorm) are fetched once here, for every panel.
            is_cut = [p is not None and p.index is None for p in cuts]
            cut = zip(leaves, cuts, is_cut, strict=True)
            pieces = [_split(a, p.axis, count) for a, p, is_panel in cut if is_panel]
            fixed = fetch([a for a, is_panel in zip(leaves, is_cut, strict=True) if not is_panel])

            def run_panel(c, piece):
                panels, others = iter(piece), iter(fixed)
                used = [next(panels) if is_panel else next(others) for is_panel in is_cut]
                return run_step(step, c, tree.unflatten(used), None, layer_params)

            first, rest = [p[0] for p in pieces], [p[1:] for p in pieces]
        carry = run_panel(carry, first)
        if count > 1:  # the other panels in a loop: one panel's weights gathered at a time,
            # their gradients summed into one buffer. The step's input carry[0] passes through
            # unchanged: closed over, not carried, so the loop saves it once for the backward
            # pass instead of once per panel (only the accumulated sums are carried)
            x = carry[0]
            body = lambda acc, j: (run_panel((x, *acc), j)[1:], None)
            carry = (x, *jax.lax.scan(body, carry[1:], rest)[0])
        return carry

    def matrix_by_matrix(x, layer_params):
        carry = (x,)
        for reads, step in nnx.merge(graphdef, layer_params).steps(tp, mlp_panels):
            used, panels = _select(layer_params, reads)
            if any(isinstance(r, Panel) and r.index is None for r in reads):
                carry = per_panel(step, carry, used, panels, layer_params)
            else:
                carry = run_step(step, carry, used, panels, layer_params)
        return carry[0]

    # the layer is the outer remat unit either way: only its input is saved per layer (and per
    # pipeline tick); the steps' inputs live only while that layer's backward pass runs
    layer = matrix_by_matrix if stream == "matrix" else whole_layer
    layer_fn = remat(layer, remat_policy, offload=offload_activations)
    stacked = nnx.to_pure_dict(stacked)
    phase_fetch = None if step_fetch else fetch
    if virtual_stage is not None:
        index, count = virtual_stage
        size = jax.tree.leaves(stacked)[0].shape[0] // count
        if phases == 1 and phase_fetch is None:  # each layer indexed inside its remat unit:
            # the backward pass indexes it again, instead of every tick saving its layers
            pick = lambda i: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.dynamic_index_in_dim(a, index * size + i, 0, False), stacked
            )
            at = remat(lambda x, i: layer(x, pick(i)), remat_policy, offload=offload_activations)
            body = lambda x, i: (at(x, i), None)  # noqa: E731
            return jax.lax.scan(body, x, jnp.arange(size), unroll=unroll)[0]
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, index * size, size, 0)  # noqa: E731
        stacked = jax.tree.map(take, stacked)
    return scan_phases(
        layer_fn,
        x,
        stacked,
        unroll=unroll,
        phases=phases,
        fetch=phase_fetch,
        remat_policy=remat_policy,
    )


def _split(a: jax.Array, axis: int, count: int) -> jax.Array:
    """`a` cut into `count` equal panels along `axis`, stacked: `[count, ...]`."""
    shape = (*a.shape[:axis], count, a.shape[axis] // count, *a.shape[axis + 1 :])
    return jnp.moveaxis(a.reshape(shape), axis, 0)

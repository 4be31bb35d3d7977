"""Streaming a layer matrix by matrix (`memory.stream=matrix`).

The layer describes itself as steps (`Layer.steps`: each reads at most one weight matrix, or
one panel of one); here each step is a remat unit nested in the layer's, its weights made
ready (fetched, gathered, cast) inside it, so one matrix is alive at a time and the backward
pass recomputes the layer, then each step again (gathering its matrix again). A step that
reads `Panel(index=None)` runs once per panel: the first, then a `lax.scan` over the others,
their gradients added into one buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.parallel.offload import is_resting
from jaxpod.parallel.remat import remat


class Panel(NamedTuple):
    """Panel `index` of `count` equal panels (contiguous rows or columns) of the
    parameter at `path` (e.g. `"mlp/w_in"`) along `axis` of one layer's array;
    `index=None`: each panel in turn (the step runs `count` times, a loop over them).
    A layer's steps name one as the plain tuple `(path, axis, index, count)`."""

    path: str
    axis: int
    index: int | None
    count: int


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
        pdst[leaf] = jax.tree.map(lambda _, p=panel: p, src[leaf], is_leaf=is_resting)
    return out, panels


def _overlay(base: dict, top: dict) -> dict:
    """`base` with the entries of `top` (a `_select` of it) replaced."""
    return {
        k: (_overlay(v, top[k]) if isinstance(v, dict) else top[k]) if k in top else v
        for k, v in base.items()
    }


def _run_step(step, carry, used, panels, layer_params, graphdef, ready, remat_policy, index):
    """One step of a layer, a remat unit: `step(layer, carry)` on the layer whose `used`
    params (their `panels` taken; layer `index` of the stack when each step fetches) are
    made ready inside the unit."""

    def fn(carry, used):
        computed = ready(used, carry[0], panels, index)
        return step(nnx.merge(graphdef, _overlay(layer_params, computed)), carry)

    return remat(fn, remat_policy, prevent_cse=True)(carry, used)


def _per_panel(step, carry, used, panels, layer_params, run_step):
    """A step reading `Panel(index=None)`: run for each of its panels, the first and then a
    loop over the others (one panel's weights gathered at a time, their gradients summed
    into one buffer). The panel index is traced: each panel is taken of the stored (or
    fetched) weights inside its step."""
    tree = jax.tree.structure(used, is_leaf=is_resting)
    cuts = tree.flatten_up_to(panels)
    count = next(p.count for p in cuts if p is not None and p.index is None)
    index = lambda p, j: p if p is None or p.index is not None else p._replace(index=j)
    at = lambda j: tree.unflatten([index(p, j) for p in cuts])
    run_panel = lambda c, j: run_step(step, c, used, at(j), layer_params)
    carry = run_panel(carry, 0)
    if count > 1:  # the step's input carry[0] passes through unchanged: closed over, not
        # carried, so the loop saves it once for the backward pass instead of once per panel
        x = carry[0]
        body = lambda acc, j: (run_panel((x, *acc), j)[1:], None)
        carry = (x, *jax.lax.scan(body, carry[1:], jnp.arange(1, count))[0])
    return carry


def matrix_layer(
    graphdef, tp: str | None, ready: Callable, remat_policy: str, mlp_panels: int
) -> Callable:
    """`layer(x, layer_params, index=None) -> y`: the layer of `graphdef` run as its
    `steps(tp, mlp_panels)`, each step a remat unit whose weights `ready` makes ready.
    `index` (each step fetching its own weights): `layer_params` is the whole `[L, ...]`
    stack and `ready` reads layer `index` of it."""

    def layer(x, layer_params, index=None):
        def run_step(step, carry, used, panels, layer_params):
            args = (graphdef, ready, remat_policy, index)
            return _run_step(step, carry, used, panels, layer_params, *args)

        carry = (x,)
        for reads, step in nnx.merge(graphdef, layer_params).steps(tp, mlp_panels):
            reads = tuple(r if isinstance(r, str) else Panel(*r) for r in reads)
            used, panels = _select(layer_params, reads)
            if any(isinstance(r, Panel) and r.index is None for r in reads):
                carry = _per_panel(step, carry, used, panels, layer_params, run_step)
            else:
                carry = run_step(step, carry, used, panels, layer_params)
        return carry[0]

    return layer

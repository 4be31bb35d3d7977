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
        pdst[leaf] = jax.tree.map(lambda _, p=panel: p, src[leaf])
    return out, panels


def _overlay(base: dict, top: dict) -> dict:
    """`base` with the entries of `top` (a `_select` of it) replaced."""
    return {
        k: (_overlay(v, top[k]) if isinstance(v, dict) else top[k]) if k in top else v
        for k, v in base.items()
    }


def _run_step(step, carry, used, panels, layer_params, graphdef, ready, remat_policy):
    """One step of a layer, a remat unit: `step(layer, carry)` on the layer whose `used`
    params (their `panels` taken) are made ready inside the unit."""

    def fn(carry, used):
        layer = nnx.merge(graphdef, _overlay(layer_params, ready(used, carry[0], panels)))
        return step(layer, carry)

    return remat(fn, remat_policy, prevent_cse=True)(carry, used)


def _per_panel(step, carry, used, panels, layer_params, run_step, fetch):
    """A step reading `Panel(index=None)`: run for each of its panels, the first and then a
    loop over the others (one panel's weights gathered at a time, their gradients summed
    into one buffer). `fetch` (host-resident weights): the panels are cut before the loop,
    which runs over them (its xs), each fetched inside its step; the other leaves
    (LayerNorm) are fetched once here, for every panel."""
    leaves, tree = jax.tree.flatten(used)
    cuts = tree.flatten_up_to(panels)
    count = next(p.count for p in cuts if p is not None and p.index is None)
    if fetch is None:  # the panel index traced: taken of the stored weights in the step
        index = lambda p, j: p if p is None or p.index is not None else p._replace(index=j)
        at = lambda j: tree.unflatten([index(p, j) for p in cuts])
        run_panel = lambda c, j: run_step(step, c, used, at(j), layer_params)
        first, rest = 0, jnp.arange(1, count)
    else:
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
    if count > 1:  # the step's input carry[0] passes through unchanged: closed over, not
        # carried, so the loop saves it once for the backward pass instead of once per panel
        x = carry[0]
        body = lambda acc, j: (run_panel((x, *acc), j)[1:], None)
        carry = (x, *jax.lax.scan(body, carry[1:], rest)[0])
    return carry


def matrix_layer(
    graphdef,
    tp: str | None,
    ready: Callable,
    remat_policy: str,
    mlp_panels: int,
    fetch: Callable | None,
) -> Callable:
    """`layer(x, layer_params) -> y`: the layer of `graphdef` run as its `steps(tp,
    mlp_panels)`, each step a remat unit whose weights `ready` makes ready; `fetch` is the
    per-step fetch `ready` applies (None: nothing fetched per step)."""

    def run_step(step, carry, used, panels, layer_params):
        return _run_step(step, carry, used, panels, layer_params, graphdef, ready, remat_policy)

    def layer(x, layer_params):
        carry = (x,)
        for reads, step in nnx.merge(graphdef, layer_params).steps(tp, mlp_panels):
            reads = tuple(r if isinstance(r, str) else Panel(*r) for r in reads)
            used, panels = _select(layer_params, reads)
            if any(isinstance(r, Panel) and r.index is None for r in reads):
                carry = _per_panel(step, carry, used, panels, layer_params, run_step, fetch)
            else:
                carry = run_step(step, carry, used, panels, layer_params)
        return carry[0]

    return layer


def _split(a: jax.Array, axis: int, count: int) -> jax.Array:
    """`a` cut into `count` equal panels along `axis`, stacked: `[count, ...]`."""
    shape = (*a.shape[:axis], count, a.shape[axis] // count, *a.shape[axis + 1 :])
    return jnp.moveaxis(a.reshape(shape), axis, 0)

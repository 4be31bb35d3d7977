"""The update tensor by tensor, one layer at a time: how 16-bit master weights are updated.

Applied to the whole tree at once (`guarded.whole_tree`), XLA holds float32 copies of the
params, the moments and the grads plus the random bits of stochastic rounding all at once,
more than a float32 step. A pod streams the update instead, and so does `per_layer`:

1. The global norm of the unscaled gradients is a reduction over the 16-bit gradients, a
   stacked leaf layer by layer (no float32 copy of the stack).
2. The small non-layer leaves (final norm, positions) are updated as a whole.
3. Each stacked tensor `[L, ...]` (with its moments) gets its own `fori_loop` over the `L / p`
   layers of a pipeline stage: iteration `j` takes layer `j` of every stage, a `[p, ...]`
   slice still split over `pipeline` (nothing moves between stages), upcasts it, runs the
   optimizer (trust ratios per layer), rounds it back and writes it into the carry.
4. A layer slice or a large non-layer leaf (the token table) is updated in up to 8 strided
   strips (`jaxpod.optim.strips`: each a slice of every device's own shard). A trust ratio
   needs the whole tensor's norms first, so LAMB/LARS take two passes over the strips
   (`trust_probe`, then `trust_norms`; `chains.scale_by_layerwise_trust_ratio`).

The arithmetic is the whole-tree update's, so float32 results agree with it to rounding;
16-bit masters get stochastic rounding from per-layer keys (`fold_in(key, 1 + j)`, then per
strip and leaf; `rbg` bits for the small leaves): equal in distribution, not bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpod.optim.guarded import Apply
from jaxpod.optim.phased import state_owners
from jaxpod.optim.precision import (
    F32,
    apply_updates,
    cast_tree_like,
    select_tree,
    sum_squares,
    to_float32,
    unscale_grads,
)
from jaxpod.optim.strips import MIN_STRIP, strips

__all__ = ["per_layer"]


def per_layer(
    optimizer: optax.GradientTransformation,
    stacked_mask,
    *,
    stages: int,
    devices: int = 1,
    min_strip: int = MIN_STRIP,
) -> tuple[Callable, Apply]:
    """`(grad_sum_squares, apply)` for `guarded.guarded_update`, updating tensor by tensor,
    one layer per stage at a time (module docstring).

    `optimizer` must not clip (the guard clips). `stacked_mask`: True for the stacked layer
    leaves `[L, ...]`, split over `pipeline` on the layer axis (`stages` divides L)."""
    stacked = [i for i, m in enumerate(jax.tree.leaves(stacked_mask)) if m]
    cut = _Cut(stacked, stages, devices, min_strip)
    return functools.partial(_grad_sum_squares, cut), functools.partial(_apply, cut, optimizer)


class _Cut(NamedTuple):
    """How `per_layer` cuts the tree: `stacked`, the indices of the stacked layer leaves
    `[L, ...]` (split over `pipeline` on the layer axis, `stages` divides L); `devices` and
    `min_strip`, what `strips` needs to cut one tensor."""

    stacked: list[int]
    stages: int
    devices: int
    min_strip: int

    def split(self, x: jax.Array) -> jax.Array:
        """`[L, ...] -> [p, L/p, ...]`: column j is layer j of every stage (still split over
        `pipeline` on its first axis: nothing moves between stages)."""
        return x.reshape(self.stages, x.shape[0] // self.stages, *x.shape[1:])


def _take(x: jax.Array, j) -> jax.Array:
    """Column `j` of a `_Cut.split` leaf: layer j of every stage, `[p, ...]`."""
    return jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False)


def _empty(x: jax.Array) -> jax.Array:
    """A leaf left out of an optimizer call: `[0]` of `x`'s dtype (the optimizer's no-op)."""
    return jnp.zeros((0,), jnp.asarray(x).dtype)


def _rbg(key: jax.Array) -> jax.Array:
    """An `rbg` key (XLA's RngBitGenerator) drawn from a threefry `key`, for the rounding of
    the small non-layer leaves, updated whole: its bits cost no temporaries, where threefry
    needs ~3x their size. Not inside the loops (layers, strips): there XLA partitions
    RngBitGenerator badly: many times the bytes of the same loops with threefry."""
    return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")


def _grad_sum_squares(cut: _Cut, grads, loss_scale) -> jax.Array:
    """sum((g / scale)**2) in float32, a stacked leaf layer by layer (XLA would otherwise
    materialise the float32 upcast of the whole stack first)."""

    def leaf_sum(g, layered):
        if not layered:
            return sum_squares(unscale_grads(g, loss_scale))
        g = cut.split(g)
        add = lambda j, acc: acc + sum_squares(unscale_grads(_take(g, j), loss_scale))
        return jax.lax.fori_loop(0, g.shape[1], add, F32(0.0))

    return sum(leaf_sum(g, n in cut.stacked) for n, g in enumerate(jax.tree.leaves(grads)))


class _Trees(NamedTuple):
    """One update's flattened trees and the optimizer that runs on any part of them.

    `grads`, `params` and `state` (the optimizer state's) leaves, with their tree defs;
    `owner[n]`: the parameter that state leaf n belongs to (-1: none, e.g. step counts, which
    every call advances alike: they are taken from the non-layer call); `owned[i]`: the
    state leaves of parameter i. `ready(g)` unscales and clips a part of the gradients,
    `finite` says whether the step is taken (`guarded.Apply`)."""

    optimizer: optax.GradientTransformation
    ready: Callable
    finite: jax.Array
    grads: list
    params: list
    params_def: Any
    state: list
    state_def: Any
    owner: list[int]
    owned: dict[int, list[int]]

    @classmethod
    def flatten(cls, optimizer, ready, finite, grads, opt_state, params) -> _Trees:
        """The trees' leaves, and which parameter owns each optimizer-state leaf."""
        p_leaves, p_def = jax.tree.flatten(params)
        s_leaves, s_def = jax.tree.flatten(opt_state)
        owner = state_owners(optimizer, opt_state, params)
        owned = {i: [n for n, o in enumerate(owner) if o == i] for i in range(len(p_leaves))}
        g_leaves = jax.tree.leaves(grads)
        return cls(
            optimizer, ready, finite, g_leaves, p_leaves, p_def, s_leaves, s_def, owner, owned
        )

    def step(self, g, s, p, **extra):
        """The optimizer on float32 upcasts of a (partial) tree; empty leaves are no-ops.
        `extra`: the trust-ratio arguments of `chains.scale_by_layerwise_trust_ratio`."""
        return self.optimizer.update(self.ready(g), to_float32(s), to_float32(p), **extra)

    def update(self, g, s, p, kp, ks, **extra):
        """`step`, then the new params and state rounded back (keys `kp`, `ks`; kept as they
        were if the step is not finite), and the sum of squares of the update."""
        upd, s32 = self.step(g, s, p, **extra)
        new_p = select_tree(self.finite, apply_updates(p, upd, kp), p)
        new_s = select_tree(self.finite, cast_tree_like(s32, s, ks), s)
        return new_p, new_s, sum_squares(upd)

    def alone(self, i, g, states, p):
        """(grads, state, params) trees holding leaf `i` (`g`, `p`, its state leaves
        `states`) and nothing else: the other leaves empty, the step counts as they are."""
        state_of = dict(zip(self.owned[i], states, strict=True))
        pick = lambda n, own, x: state_of[n] if n in state_of else x if own < 0 else _empty(x)
        g_all = [g if n == i else _empty(x) for n, x in enumerate(self.grads)]
        p_all = [p if n == i else _empty(x) for n, x in enumerate(self.params)]
        owners = zip(self.owner, self.state, strict=True)
        s_all = [pick(n, own, x) for n, (own, x) in enumerate(owners)]
        return (
            jax.tree.unflatten(self.params_def, g_all),
            jax.tree.unflatten(self.state_def, s_all),
            jax.tree.unflatten(self.params_def, p_all),
        )

    def leaves_of(self, i, out_p, out_s) -> tuple[jax.Array, list]:
        """Leaf `i` and its state leaves, out of `update`'s trees."""
        return jax.tree.leaves(out_p)[i], [jax.tree.leaves(out_s)[n] for n in self.owned[i]]


class _Strips(NamedTuple):
    """A tensor's strided strips (`jaxpod.optim.strips`): its axis `axis` of size n viewed as
    `[n / count, count]`, strip b being column b of that view (a slice of every device's own
    shard: nothing moves)."""

    axis: int
    count: int

    def view(self, x: jax.Array) -> jax.Array:
        """`x` with its strip axis n viewed as `[n / count, count]`."""
        a = self.axis
        return x.reshape(*x.shape[:a], x.shape[a] // self.count, self.count, *x.shape[a + 1 :])

    def strip(self, x: jax.Array, b) -> jax.Array:
        """Strip `b` of a `view`."""
        return jax.lax.dynamic_index_in_dim(x, b, self.axis + 1, keepdims=False)

    def put(self, x: jax.Array, part: jax.Array, b) -> jax.Array:
        """`view` `x` with strip `b` replaced by `part`."""
        return jax.lax.dynamic_update_index_in_dim(x, part, b, self.axis + 1)


def _trust_norms(trees: _Trees, i: int, cut: _Strips, gv, sv, pv) -> dict:
    """The optimizer's extra arguments for leaf `i` updated in strips (`gv`, `sv`, `pv`: the
    `view`s of its grads, state leaves and params): none without a trust ratio; with one,
    `{"trust_norms": {i: norms}}`, the whole tensor's norms of the weights and of the update
    the ratio scales, summed over a first pass over the strips (`trust_probe`)."""

    def measure(b, total=None):
        probe = {}
        strip_trees = trees.alone(
            i, cut.strip(gv, b), [cut.strip(x, b) for x in sv], cut.strip(pv, b)
        )
        trees.step(*strip_trees, trust_probe=probe)
        if i not in probe:
            return None
        return probe[i] if total is None else jax.tree.map(jnp.add, total, probe[i])

    zeros = jax.eval_shape(lambda: measure(0))
    if zeros is None:
        return {}
    zeros = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros)
    squares = jax.lax.fori_loop(0, cut.count, measure, zeros)
    return {"trust_norms": {i: tuple(jnp.sqrt(x) for x in squares)}}


def _leaf_update(trees: _Trees, cut: _Cut, i: int, g, states, p, kp, ks, leading: bool):
    """`(p, states, sum of squares of the update)`: leaf `i` (or one layer of it: `leading`,
    `[stages, ...]`) and its state leaves updated, in the strips `strips` chooses; a trust
    ratio takes two passes over them (`_trust_norms` first). Strip b rounds with keys
    `fold_in(kp, b)`, `fold_in(ks, b)`; a leaf in one strip with `kp`, `ks` themselves."""
    axis, count = strips(p.shape, cut.devices, leading, cut.min_strip)
    if count == 1:
        out_p, out_s, sq = trees.update(*trees.alone(i, g, states, p), kp, ks)
        return *trees.leaves_of(i, out_p, out_s), sq
    by = _Strips(axis, count)
    gv, pv, sv = by.view(g), by.view(p), [by.view(x) for x in states]
    extra = _trust_norms(trees, i, by, gv, sv, pv)

    def apply_strip(b, carry):
        p_all, s_all, total = carry
        strip_trees = trees.alone(
            i, by.strip(gv, b), [by.strip(x, b) for x in s_all], by.strip(p_all, b)
        )
        kb, kbs = jax.random.fold_in(kp, b), jax.random.fold_in(ks, b)
        out_p, out_s, sq = trees.update(*strip_trees, kb, kbs, **extra)
        out_s = jax.tree.leaves(out_s)
        p_all = by.put(p_all, jax.tree.leaves(out_p)[i], b)
        s_all = [by.put(x, out_s[n], b) for n, x in zip(trees.owned[i], s_all, strict=True)]
        return p_all, s_all, total + sq

    pv, sv, sq = jax.lax.fori_loop(0, count, apply_strip, (pv, sv, F32(0.0)))
    states = [x.reshape(y.shape) for x, y in zip(sv, states, strict=True)]
    return pv.reshape(p.shape), states, sq


def _update_whole(trees: _Trees, skip: set[int], k_params, k_state):
    """`(params leaves, state leaves, sum of squares)`: the small non-layer leaves updated in
    one call, as a whole, rounding with `rbg` keys (`_rbg`); the leaves in `skip` (stacked
    or in strips) are left empty, updated by the loops after."""
    whole = lambda n, x: _empty(x) if n in skip else x
    owners = zip(trees.owner, trees.state, strict=True)
    rest = (
        jax.tree.unflatten(trees.params_def, [whole(n, x) for n, x in enumerate(trees.grads)]),
        jax.tree.unflatten(trees.state_def, [whole(o, x) for o, x in owners]),
        jax.tree.unflatten(trees.params_def, [whole(n, x) for n, x in enumerate(trees.params)]),
    )
    rest_p, rest_s, sq = trees.update(*rest, _rbg(k_params), _rbg(k_state))
    return jax.tree.leaves(rest_p), jax.tree.leaves(rest_s), sq


def _update_in_strips(trees: _Trees, cut: _Cut, i: int, k_params, k_state):
    """`_leaf_update` of a large non-layer leaf `i` (the token table), alone, in strips:
    threefry keys from `fold_in(key, 0)` (the layers use 1 + j), then `1 + i`."""
    kp, ks = jax.random.fold_in(k_params, 0), jax.random.fold_in(k_state, 0)
    kp, ks = jax.random.fold_in(kp, 1 + i), jax.random.fold_in(ks, 1 + i)
    states = [trees.state[n] for n in trees.owned[i]]
    return _leaf_update(trees, cut, i, trees.grads[i], states, trees.params[i], kp, ks, False)


def _update_stacked(trees: _Trees, cut: _Cut, i: int, k_params, k_state):
    """`(params, state leaves, sum of squares)` of the stacked leaf `i`, each still
    `_Cut.split` (`[p, L/p, ...]`): a `fori_loop` over j updates `[:, j]`, layer j of every
    stage, `[p, ...]` (`_leaf_update`, keys `fold_in(key, 1 + j)`), and writes it back."""

    def body(j, carry):
        p, states, total = carry
        kp, ks = jax.random.fold_in(k_params, 1 + j), jax.random.fold_in(k_state, 1 + j)
        g = _take(cut.split(trees.grads[i]), j)
        out_p, out_s, sq_j = _leaf_update(
            trees, cut, i, g, [_take(x, j) for x in states], _take(p, j), kp, ks, True
        )
        put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part, j, 1)
        p = put(p, out_p)
        states = [put(x, y) for x, y in zip(states, out_s, strict=True)]
        return p, states, total + sq_j

    init = (
        cut.split(trees.params[i]),
        [cut.split(trees.state[n]) for n in trees.owned[i]],
        F32(0.0),
    )
    return jax.lax.fori_loop(0, trees.params[i].shape[0] // cut.stages, body, init)


def _apply(cut: _Cut, optimizer, ready, finite, grads, opt_state, params, key):
    """`guarded.Apply` tensor by tensor (module docstring): the small non-layer leaves as a
    whole, then each large non-layer leaf in strips, then each stacked leaf layer by layer.
    Returns the new params and optimizer state and the sum of squares of the update."""
    k_params, k_state = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    trees = _Trees.flatten(optimizer, ready, finite, grads, opt_state, params)
    in_strips = {
        n
        for n, x in enumerate(trees.params)
        if n not in cut.stacked and strips(x.shape, cut.devices, False, cut.min_strip)[1] > 1
    }
    new_p, new_s, sq = _update_whole(trees, set(cut.stacked) | in_strips, k_params, k_state)

    for i in sorted(in_strips):
        new_p[i], states, sq_i = _update_in_strips(trees, cut, i, k_params, k_state)
        sq = sq + sq_i
        for n, x in zip(trees.owned[i], states, strict=True):
            new_s[n] = x

    for i in cut.stacked:  # [p, L/p, ...] back to [L, ...]
        if trees.params[i].size == 0:  # left out of this call (`jaxpod.optim.phased`)
            continue
        p_i, states, sq_i = _update_stacked(trees, cut, i, k_params, k_state)
        sq = sq + sq_i
        new_p[i] = p_i.reshape(trees.params[i].shape)
        for n, x in zip(trees.owned[i], states, strict=True):
            new_s[n] = x.reshape(trees.state[n].shape)

    return (
        jax.tree.unflatten(trees.params_def, new_p),
        jax.tree.unflatten(trees.state_def, new_s),
        sq,
    )

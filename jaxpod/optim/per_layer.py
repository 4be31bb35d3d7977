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

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxpod.optim.guarded import Apply
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


def _empty(x: jax.Array) -> jax.Array:
    return jnp.zeros((0,), jnp.asarray(x).dtype)


def _rbg(key: jax.Array) -> jax.Array:
    """An `rbg` key (XLA's RngBitGenerator) drawn from a threefry `key`, for the rounding of
    the small non-layer leaves, updated whole: its bits cost no temporaries, where threefry
    needs ~3x their size. Not inside the loops (layers, strips): there XLA partitions
    RngBitGenerator badly: many times the bytes of the same loops with threefry."""
    return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")


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

    def split(x):  # [L, ...] -> [p, L/p, ...]: column j is layer j of every stage
        return x.reshape(stages, x.shape[0] // stages, *x.shape[1:])

    def take(x, j):
        return jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False)

    def grad_sum_squares(grads, loss_scale) -> jax.Array:
        """sum((g / scale)**2) in float32, a stacked leaf layer by layer (XLA would otherwise
        materialise the float32 upcast of the whole stack first)."""

        def leaf_sum(g, layered):
            if not layered:
                return sum_squares(unscale_grads(g, loss_scale))
            g = split(g)
            add = lambda j, acc: acc + sum_squares(unscale_grads(take(g, j), loss_scale))
            return jax.lax.fori_loop(0, g.shape[1], add, F32(0.0))

        return sum(leaf_sum(g, n in stacked) for n, g in enumerate(jax.tree.leaves(grads)))

    def apply(ready, finite, grads, opt_state, params, key):
        g_leaves = jax.tree.leaves(grads)
        k_params, k_state = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)

        def step(g, s, p, **extra):
            """The optimizer on float32 upcasts of a (partial) tree; empty leaves are no-ops.
            `extra`: the trust-ratio arguments of `chains.scale_by_layerwise_trust_ratio`."""
            return optimizer.update(ready(g), to_float32(s), to_float32(p), **extra)

        def update(g, s, p, kp, ks, **extra):
            """`step`, then the new params and state rounded back (kept as they were if the
            step is not finite), and the sum of squares of the update."""
            upd, s32 = step(g, s, p, **extra)
            new_p = select_tree(finite, apply_updates(p, upd, kp), p)
            new_s = select_tree(finite, cast_tree_like(s32, s, ks), s)
            return new_p, new_s, sum_squares(upd)

        # Which parameter each optimizer-state leaf belongs to (-1: none, e.g. step counts,
        # which every call advances alike: they are taken from the non-layer call).
        p_leaves, p_def = jax.tree.flatten(params)
        s_leaves, s_def = jax.tree.flatten(opt_state)
        owner = jax.tree.leaves(
            optax.tree_map_params(
                optimizer,
                lambda _, i: i,
                opt_state,
                jax.tree.unflatten(p_def, list(range(len(p_leaves)))),
                transform_non_params=lambda _: -1,
            )
        )
        owned = {i: [n for n, o in enumerate(owner) if o == i] for i in range(len(p_leaves))}

        def alone(i, g, states, p):
            """(grads, state, params) trees holding leaf `i` (`g`, `p`, its state leaves
            `states`) and nothing else: the other leaves empty, the step counts as they are."""
            state_of = dict(zip(owned[i], states, strict=True))
            pick = lambda n, own, x: state_of[n] if n in state_of else x if own < 0 else _empty(x)
            g_all = [g if n == i else _empty(x) for n, x in enumerate(g_leaves)]
            p_all = [p if n == i else _empty(x) for n, x in enumerate(p_leaves)]
            s_all = [
                pick(n, own, x) for n, (own, x) in enumerate(zip(owner, s_leaves, strict=True))
            ]
            return (
                jax.tree.unflatten(p_def, g_all),
                jax.tree.unflatten(s_def, s_all),
                jax.tree.unflatten(p_def, p_all),
            )

        def leaf_update(i, g, states, p, kp, ks, leading):
            """Update leaf `i` (or one layer of it: `leading`, `[stages, ...]`) in the strips of
            `strips`; a trust ratio takes two passes over them, the first summing the squares
            of the weights and of the update it scales (`trust_probe`), the second applying
            it with the whole tensor's norms (`trust_norms`)."""
            axis, count = strips(p.shape, devices, leading, min_strip)
            if count == 1:
                out_p, out_s, sq = update(*alone(i, g, states, p), kp, ks)
                return jax.tree.leaves(out_p)[i], [jax.tree.leaves(out_s)[n] for n in owned[i]], sq
            view = lambda x: x.reshape(
                *x.shape[:axis], x.shape[axis] // count, count, *x.shape[axis + 1 :]
            )
            strip = lambda x, b: jax.lax.dynamic_index_in_dim(x, b, axis + 1, keepdims=False)
            put = lambda x, part, b: jax.lax.dynamic_update_index_in_dim(x, part, b, axis + 1)
            gv, pv, sv = view(g), view(p), [view(x) for x in states]

            def measure(b, total=None):
                probe = {}
                trees = alone(i, strip(gv, b), [strip(x, b) for x in sv], strip(pv, b))
                step(*trees, trust_probe=probe)
                if i not in probe:
                    return None
                return probe[i] if total is None else jax.tree.map(jnp.add, total, probe[i])

            extra = {}
            zeros = jax.eval_shape(lambda: measure(0))
            if zeros is not None:  # a trust ratio: the whole tensor's norms first
                zeros = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros)
                squares = jax.lax.fori_loop(0, count, measure, zeros)
                extra["trust_norms"] = {i: tuple(jnp.sqrt(x) for x in squares)}

            def apply_strip(b, carry):
                p_all, s_all, total = carry
                trees = alone(i, strip(gv, b), [strip(x, b) for x in s_all], strip(p_all, b))
                kb, kbs = jax.random.fold_in(kp, b), jax.random.fold_in(ks, b)
                out_p, out_s, sq = update(*trees, kb, kbs, **extra)
                out_s = jax.tree.leaves(out_s)
                p_all = put(p_all, jax.tree.leaves(out_p)[i], b)
                s_all = [put(x, out_s[n], b) for n, x in zip(owned[i], s_all, strict=True)]
                return p_all, s_all, total + sq

            pv, sv, sq = jax.lax.fori_loop(0, count, apply_strip, (pv, sv, F32(0.0)))
            states = [x.reshape(y.shape) for x, y in zip(sv, states, strict=True)]
            return pv.reshape(p.shape), states, sq

        # Small non-layer leaves: one call, as a whole (stacked and strip-wise leaves empty).
        in_strips = {
            n
            for n, x in enumerate(p_leaves)
            if n not in stacked and strips(x.shape, devices, False, min_strip)[1] > 1
        }
        whole = lambda n, x: _empty(x) if n in stacked or n in in_strips else x
        rest = (
            jax.tree.unflatten(p_def, [whole(n, x) for n, x in enumerate(g_leaves)]),
            jax.tree.unflatten(
                s_def,
                [
                    _empty(x) if o in stacked or o in in_strips else x
                    for o, x in zip(owner, s_leaves, strict=True)
                ],
            ),
            jax.tree.unflatten(p_def, [whole(n, x) for n, x in enumerate(p_leaves)]),
        )
        rest_p, rest_s, sq = update(*rest, _rbg(k_params), _rbg(k_state))
        new_p, new_s = jax.tree.leaves(rest_p), jax.tree.leaves(rest_s)

        # Large non-layer leaves (token tables): one at a time, in strips (threefry keys from
        # `fold_in(key, 0)`: the layers use 1 + j).
        for i in sorted(in_strips):
            kp, ks = jax.random.fold_in(k_params, 0), jax.random.fold_in(k_state, 0)
            kp, ks = jax.random.fold_in(kp, 1 + i), jax.random.fold_in(ks, 1 + i)
            states = [s_leaves[n] for n in owned[i]]
            new_p[i], states, sq_i = leaf_update(i, g_leaves[i], states, p_leaves[i], kp, ks, False)
            sq = sq + sq_i
            for n, x in zip(owned[i], states, strict=True):
                new_s[n] = x

        # each stacked leaf [L, ...] -> [p, L/p, ...]: a loop over j updates [:, j] of it alone
        for i in stacked:
            mine = owned[i]

            def body(j, carry, i=i, mine=mine):
                p, states, total = carry
                kp, ks = jax.random.fold_in(k_params, 1 + j), jax.random.fold_in(k_state, 1 + j)
                out_p, out_s, sq_j = leaf_update(
                    i,
                    take(split(g_leaves[i]), j),
                    [take(x, j) for x in states],
                    take(p, j),
                    kp,
                    ks,
                    True,
                )
                put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part, j, 1)
                p = put(p, out_p)
                states = [put(x, y) for x, y in zip(states, out_s, strict=True)]
                return p, states, total + sq_j

            init = (split(p_leaves[i]), [split(s_leaves[n]) for n in mine], F32(0.0))
            p_i, states, sq_i = jax.lax.fori_loop(0, p_leaves[i].shape[0] // stages, body, init)
            sq = sq + sq_i
            new_p[i] = p_i.reshape(p_leaves[i].shape)
            for n, x in zip(mine, states, strict=True):
                new_s[n] = x.reshape(s_leaves[n].shape)

        return jax.tree.unflatten(p_def, new_p), jax.tree.unflatten(s_def, new_s), sq

    return grad_sum_squares, apply

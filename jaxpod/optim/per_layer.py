"""The optimizer update tensor by tensor, one layer at a time: the lean update for 16-bit masters.

`precision.guarded_update` runs optax on float32 upcasts of the whole tree. With 16-bit master
weights XLA then holds float32 copies of the params, the moments and the grads (they cannot
alias the 16-bit buffers) plus the random bits of stochastic rounding, all at once: on a
weights-dominated config the FP16 + LAMB step held 3.6x the planner's bytes and more than the
float32 LAMB step (docs/benchmarks.md). A pod streams the update instead, and so does this:

1. Reductions first, over the 16-bit gradients (fused, no upcast tree): the global norm of
   the unscaled gradients (non-finite if any element is inf/NaN: the step is then skipped)
   and from it the clip factor `min(1, max_norm / norm)`.
2. The small non-layer leaves (final norm, positions of a small model) are updated as a whole.
3. Each stacked block tensor `[L, ...]` (with its moments) gets its own `fori_loop` over the
   `L / p` layers of a pipeline stage: iteration `j` takes layer `j` of every stage — a
   `[p, ...]` slice, still split over `pipeline` like the stack, so nothing moves between
   stages — upcasts it, runs the optimizer (LARS/LAMB trust ratios stay per layer: the
   slice's leading axis is the layer axis), rounds it back and writes it into the carry.
4. A layer slice or a non-layer leaf (the token embedding) large enough is updated in up to
   8 strided blocks (`jaxpod.optim.strips`: each block a slice of every device's own
   shard). The trust ratio needs the norms of the whole tensor before any block is scaled,
   so LAMB/LARS take two passes: the first sums the squares of the weights and of the
   update the ratio scales (`trust_probe`), the second recomputes each block's update and
   applies it with the whole tensor's ratio (`trust_norms`; `optim.scale_by_layerwise_trust_ratio`).

The float32 working set is one block of one tensor instead of the whole model. The arithmetic
is the whole-tree update's (same clip formula, per-layer trust ratios, per-element moments),
so float32 results agree with it to rounding; 16-bit masters get stochastic rounding from
per-layer keys (`fold_in(key, 1 + j)`, then per block and leaf; `rbg` bits for the small
non-layer leaves):
equal in distribution to the whole-tree update's, not bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpod.config.load import Config, PrecisionConfig
from jaxpod.optim.chains import clip_by_norm, make_optimizer, stacked_mask
from jaxpod.optim.precision import (
    F32,
    LossScaleState,
    apply_updates,
    cast_tree_like,
    guarded_update,
    is_half,
    master_dtype,
    select_tree,
    sum_squares,
    to_float32,
    unscale_grads,
    update_loss_scale,
)
from jaxpod.optim.strips import MIN_BLOCK, update_blocks

__all__ = ["layerwise_guarded_update", "make_update"]


def make_update(cfg: Config, optimizer: optax.GradientTransformation) -> Callable:
    """The transformer engine's update `(grads, opt_state, params, loss_scale, key) ->
    (params, opt_state, loss_scale, info)` for the state of `optimizer`: layer by layer
    (`layerwise_guarded_update`) when the master weights are 16-bit, else the whole-tree
    `guarded_update`. `info` has "finite", "grad_norm" and "update_norm"."""
    if not is_half(master_dtype(cfg.precision)):
        return lambda g, s, p, ls, k: guarded_update(optimizer, g, s, p, ls, cfg.precision, k)
    unclipped, _ = make_optimizer(cfg.optim, cfg.train.steps, clip=False)

    def update(g, s, p, ls, k):
        return layerwise_guarded_update(
            unclipped, g, s, p, ls, cfg.precision, k,
            stages=cfg.mesh.pipeline, max_norm=cfg.optim.grad_clip, devices=cfg.devices,
        )  # fmt: skip

    return update


def _empty(x: jax.Array) -> jax.Array:
    return jnp.zeros((0,), jnp.asarray(x).dtype)


def _rbg(key: jax.Array) -> jax.Array:
    """An `rbg` key (XLA's RngBitGenerator) drawn from a threefry `key`, for the rounding of
    the small non-layer leaves, updated whole: its bits cost no temporaries, where threefry
    needs ~3x their size (when BERT-Large's 30528 x 1024 embedding was updated whole, 375 MB
    on one device). Not inside the loops (layers, blocks): there XLA partitions
    RngBitGenerator badly (GPT-3 POD256's temporaries grew from 21 to 57 GB; measured)."""
    return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")


def layerwise_guarded_update(
    optimizer: optax.GradientTransformation,
    grads,
    opt_state,
    params,
    loss_scale: LossScaleState,
    cfg: PrecisionConfig,
    key: jax.Array,
    *,
    stages: int,
    max_norm: float,
    devices: int = 1,
    min_block: int = MIN_BLOCK,
) -> tuple[Any, Any, LossScaleState, dict[str, jax.Array]]:
    """`precision.guarded_update`, tensor by tensor, one layer per stage at a time (module
    docstring).

    `optimizer` must not clip (`make_optimizer(..., clip=False)`); `max_norm` (> 0) clips by
    the global norm. `params`/`grads`: the engine's trees, stacked blocks `[L, ...]` split
    over `pipeline` on the layer axis (`stages` = mesh.pipeline divides L). Returns `(params,
    opt_state, loss_scale, info)` with `info = {"finite": bool[], "grad_norm": f32[] (of the
    unscaled, unclipped grads), "update_norm": f32[]}`; a non-finite step leaves params and
    state bit-identical."""
    stacked = [i for i, m in enumerate(jax.tree.leaves(stacked_mask(params))) if m]

    def split(x):  # [L, ...] -> [p, L/p, ...]: column j is layer j of every stage
        return x.reshape(stages, x.shape[0] // stages, *x.shape[1:])

    def take(x, j):
        return jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False)

    def unscaled_sum_squares(g: jax.Array, layered: bool) -> jax.Array:
        """sum((g / scale)**2) in float32; layer by layer for a stacked leaf (XLA would
        otherwise materialise the float32 upcast of the whole stack first)."""
        if not layered:
            return sum_squares(unscale_grads(g, loss_scale))
        g = split(g)
        add = lambda j, acc: acc + sum_squares(unscale_grads(take(g, j), loss_scale))
        return jax.lax.fori_loop(0, g.shape[1], add, F32(0.0))

    # The step is skipped unless the norm is finite: an inf or NaN anywhere makes the sum of
    # squares non-finite (as does a float32 sum beyond 3.4e38, a gradient norm > 1.8e19).
    g_leaves = jax.tree.leaves(grads)
    norm = jnp.sqrt(sum(unscaled_sum_squares(g, n in stacked) for n, g in enumerate(g_leaves)))
    finite = jnp.isfinite(norm)
    k_params, k_state = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)

    def step(g, s, p, **extra):
        """The optimizer on float32 upcasts of a (partial) tree; empty leaves are no-ops.
        `extra`: the trust-ratio arguments of `optim.scale_by_layerwise_trust_ratio`."""
        g32 = unscale_grads(g, loss_scale)
        if max_norm > 0:  # with the global norm: optax.clip_by_global_norm's arithmetic
            g32 = clip_by_norm(g32, norm, max_norm)
        return optimizer.update(g32, to_float32(s), to_float32(p), **extra)

    def update(g, s, p, kp, ks, **extra):
        """`step`, then the new params and state rounded back (kept as they were if the step
        is not finite), and the sum of squares of the update."""
        upd, s32 = step(g, s, p, **extra)
        new_p = select_tree(finite, apply_updates(p, upd, kp), p)
        new_s = select_tree(finite, cast_tree_like(s32, s, ks), s)
        return new_p, new_s, sum_squares(upd)

    # Which parameter each optimizer-state leaf belongs to (-1: none, e.g. step counts, which
    # every call advances alike: they are taken from the non-layer call).
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
        s_all = [pick(n, own, x) for n, (own, x) in enumerate(zip(owner, s_leaves, strict=True))]
        return (
            jax.tree.unflatten(p_def, g_all),
            jax.tree.unflatten(s_def, s_all),
            jax.tree.unflatten(p_def, p_all),
        )

    def leaf_update(i, g, states, p, kp, ks, leading):
        """Update leaf `i` (or one layer of it: `leading`, `[stages, ...]`) in the blocks of
        `update_blocks`; a trust ratio takes two passes over them, the first summing the
        squares of the weights and of the update it scales (`trust_probe`), the second
        applying it with the whole tensor's norms (`trust_norms`)."""
        axis, blocks = update_blocks(p.shape, devices, leading, min_block)
        if blocks == 1:
            out_p, out_s, sq = update(*alone(i, g, states, p), kp, ks)
            return jax.tree.leaves(out_p)[i], [jax.tree.leaves(out_s)[n] for n in owned[i]], sq
        view = lambda x: x.reshape(*x.shape[:axis], x.shape[axis] // blocks, blocks,
                                   *x.shape[axis + 1:])  # fmt: skip
        block = lambda x, b: jax.lax.dynamic_index_in_dim(x, b, axis + 1, keepdims=False)
        put = lambda x, part, b: jax.lax.dynamic_update_index_in_dim(x, part, b, axis + 1)
        gv, pv, sv = view(g), view(p), [view(x) for x in states]

        def measure(b, total=None):
            probe = {}
            trees = alone(i, block(gv, b), [block(x, b) for x in sv], block(pv, b))
            step(*trees, trust_probe=probe)
            if i not in probe:
                return None
            return probe[i] if total is None else jax.tree.map(jnp.add, total, probe[i])

        extra = {}
        zeros = jax.eval_shape(lambda: measure(0))
        if zeros is not None:  # a trust ratio: the whole tensor's norms first
            zeros = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros)
            squares = jax.lax.fori_loop(0, blocks, measure, zeros)
            extra["trust_norms"] = {i: tuple(jnp.sqrt(x) for x in squares)}

        def apply(b, carry):
            p_all, s_all, total = carry
            trees = alone(i, block(gv, b), [block(x, b) for x in s_all], block(p_all, b))
            kb, kbs = jax.random.fold_in(kp, b), jax.random.fold_in(ks, b)
            out_p, out_s, sq = update(*trees, kb, kbs, **extra)
            out_s = jax.tree.leaves(out_s)
            p_all = put(p_all, jax.tree.leaves(out_p)[i], b)
            s_all = [put(x, out_s[n], b) for n, x in zip(owned[i], s_all, strict=True)]
            return p_all, s_all, total + sq

        pv, sv, sq = jax.lax.fori_loop(0, blocks, apply, (pv, sv, F32(0.0)))
        states = [x.reshape(y.shape) for x, y in zip(sv, states, strict=True)]
        return pv.reshape(p.shape), states, sq

    # Small non-layer leaves: one call, as a whole (stacked and blocked leaves left empty).
    blocked = {
        n for n, x in enumerate(p_leaves)
        if n not in stacked and update_blocks(x.shape, devices, False, min_block)[1] > 1
    }  # fmt: skip
    whole = lambda n, x: _empty(x) if n in stacked or n in blocked else x
    rest = (
        jax.tree.unflatten(p_def, [whole(n, x) for n, x in enumerate(g_leaves)]),
        jax.tree.unflatten(s_def, [_empty(x) if o in stacked or o in blocked else x
                                   for o, x in zip(owner, s_leaves, strict=True)]),
        jax.tree.unflatten(p_def, [whole(n, x) for n, x in enumerate(p_leaves)]),
    )  # fmt: skip
    rest_p, rest_s, sq = update(*rest, _rbg(k_params), _rbg(k_state))
    new_p, new_s = jax.tree.leaves(rest_p), jax.tree.leaves(rest_s)

    # Large non-layer leaves (embeddings): one at a time, in blocks (threefry keys from
    # `fold_in(key, 0)`: the layers use 1 + j).
    for i in sorted(blocked):
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
                i, take(split(g_leaves[i]), j), [take(x, j) for x in states], take(p, j),
                kp, ks, True,
            )  # fmt: skip
            put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part, j, axis=1)
            p = put(p, out_p)
            states = [put(x, y) for x, y in zip(states, out_s, strict=True)]
            return p, states, total + sq_j

        init = (split(p_leaves[i]), [split(s_leaves[n]) for n in mine], F32(0.0))
        p_i, states, sq_i = jax.lax.fori_loop(0, p_leaves[i].shape[0] // stages, body, init)
        sq = sq + sq_i
        new_p[i] = p_i.reshape(p_leaves[i].shape)
        for n, x in zip(mine, states, strict=True):
            new_s[n] = x.reshape(s_leaves[n].shape)

    new_params, new_state = jax.tree.unflatten(p_def, new_p), jax.tree.unflatten(s_def, new_s)
    new_ls = update_loss_scale(loss_scale, finite, cfg)
    info = {"finite": finite, "grad_norm": norm, "update_norm": jnp.sqrt(sq)}
    return new_params, new_state, new_ls, info

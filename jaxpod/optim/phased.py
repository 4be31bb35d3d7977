"""The update in parts: the non-layer leaves, then the layer stack a phase at a time.

With the state resting in host memory (`memory.phases`), an update of the whole tree at once
brings every layer's weights and moments to the device together. `in_phases(apply, ...)`
wraps an `Apply` (`guarded.whole_tree`, `per_layer`) so that one part is on the device at a
time: first the non-layer leaves, then for each of K phases the layers `[k L/K, (k+1) L/K)`
of every stacked leaf, each part fetched (`fetch`), updated, put back where its leaf lives
(`store`) and written into it, before the next. A part is the optimizer on a tree of the
whole structure whose other leaves are empty (`[0]`: the optimizer's no-op); its
non-parameter state (step counts) advances in the first part only. Every transform is
per leaf or per layer (trust ratios per layer), so the arithmetic is the whole update's;
16-bit masters round with part k's keys (`fold_in(key, k)`): equal in distribution, not
bitwise. The gradients are on the device already; the norm of the new params, which only
the parts see on the device, is summed there (`norms["param_sq"]`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpod.optim.guarded import Apply
from jaxpod.optim.precision import sum_squares


def state_owners(optimizer: optax.GradientTransformation, opt_state, params) -> list[int]:
    """For each leaf of `opt_state` (flat order), the index of the parameter leaf it belongs
    to (a moment of it), or -1 for the optimizer's own leaves (step counts)."""
    leaves, treedef = jax.tree.flatten(params)
    indices = jax.tree.unflatten(treedef, list(range(len(leaves))))
    owned = optax.tree_map_params(
        optimizer, lambda _, i: i, opt_state, indices, transform_non_params=lambda _: -1
    )
    return jax.tree.leaves(owned)


def _empty(x: jax.Array) -> jax.Array:
    """A leaf left out of a part: `[0]` of `x`'s dtype (the optimizer's no-op)."""
    return jnp.zeros((0,), x.dtype)


class _Parts(NamedTuple):
    """One update's flattened trees, cut into parts (module docstring). `owner[n]`: the
    parameter state leaf n belongs to (-1: a step count, fetched once, in `counts`)."""

    apply: Apply
    ready: Callable
    finite: jax.Array
    key: jax.Array
    fetch: Callable
    grads: list
    params_def: Any
    state_def: Any
    owner: list[int]
    counts: dict

    def run(
        self, pick: Callable, k: int, params: list, state: list
    ) -> tuple[list, list, jax.Array, jax.Array]:
        """`(params, state, update's sum of squares, new params' sum of squares)` of the part
        whose leaf i is `pick(i, leaf)` (None: left empty) of `params` and `state` (the
        leaves as written so far), fetched, updated with key k."""

        def take(i, x):
            part = pick(i, x)
            return _empty(x) if part is None else self.fetch(part)

        g = [take(i, x) for i, x in enumerate(self.grads)]
        p = [take(i, x) for i, x in enumerate(params)]
        rows = enumerate(zip(self.owner, state, strict=True))
        s = [self.counts[n] if o < 0 else take(o, x) for n, (o, x) in rows]
        unflat = self.params_def.unflatten
        trees = (unflat(g), self.state_def.unflatten(s), unflat(p))
        new_p, new_s, sq = self.apply(
            self.ready, self.finite, *trees, jax.random.fold_in(self.key, k)
        )
        new_p = jax.tree.leaves(new_p)
        return new_p, jax.tree.leaves(new_s), sq, sum_squares(new_p)


def in_phases(
    apply: Apply,
    optimizer: optax.GradientTransformation,
    stacked_mask,
    phases: int,
    *,
    fetch: Callable,
    store: Callable,
    norms: dict,
) -> Apply:
    """`apply` run part by part (module docstring). `stacked_mask`: True for the stacked
    leaves `[L, ...]` (`phases` divides L); `fetch(x)`: `x` (or a slice of it) in device
    memory; `store(new, old)`: `new` put back in `old`'s memory. `norms` receives
    `param_sq`, the sum of squares of the new params."""
    stacked = {i for i, m in enumerate(jax.tree.leaves(stacked_mask)) if m}

    def run(ready, finite, grads, opt_state, params, key):
        p_leaves, p_def = jax.tree.flatten(params)
        s_leaves, s_def = jax.tree.flatten(opt_state)
        owner = state_owners(optimizer, opt_state, params)
        counts = {n: fetch(x) for n, x in enumerate(s_leaves) if owner[n] < 0}
        trees = (jax.tree.leaves(grads), p_def, s_def, owner, counts)
        parts = _Parts(apply, ready, finite, key, fetch, *trees)
        new_p, new_s = list(p_leaves), list(s_leaves)
        rest = lambda i, x: None if i in stacked else x  # noqa: E731
        out_p, out_s, update_sq, param_sq = parts.run(rest, 0, p_leaves, s_leaves)
        for i in set(range(len(p_leaves))) - stacked:
            new_p[i] = store(out_p[i], p_leaves[i])
        for n in (n for n, o in enumerate(owner) if o not in stacked):  # and the step counts
            new_s[n] = store(out_s[n], s_leaves[n])
        size = next(p_leaves[i].shape[0] for i in sorted(stacked)) // phases
        for k in range(phases):
            start = k * size
            layers = lambda i, x, a=start: (  # noqa: E731
                jax.lax.slice_in_dim(x, a, a + size) if i in stacked else None
            )
            # read from the leaves as written so far (phase k's rows are still the old ones):
            # each write then updates the buffer the next phase reads, in place, and XLA
            # keeps no copy of the old stack for the phases still to read it
            out_p, out_s, sq, psq = parts.run(layers, 1 + k, new_p, new_s)
            update_sq, param_sq = update_sq + sq, param_sq + psq
            write = lambda full, new, a=start: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                full, store(new, full), a, 0
            )
            for i in stacked:
                new_p[i] = write(new_p[i], out_p[i])
            for n in (n for n, o in enumerate(owner) if o in stacked):
                new_s[n] = write(new_s[n], out_s[n])
        norms["param_sq"] = param_sq
        return p_def.unflatten(new_p), s_def.unflatten(new_s), update_sq

    return run

"""The one guarded optimizer update: unscale, check, clip, apply, skip, adjust the loss scale.

Every engine path goes through `guarded_update`; only *how* the optimizer is applied to the
state differs (an `Apply` function):

- `whole_tree(optimizer)`: optax on float32 upcasts of the whole tree at once (float32 master
  weights; also each packed pipeline stage's tree);
- `jaxpod.optim.per_layer`: tensor by tensor, one layer per stage at a time, large tensors in
  strips (16-bit master weights, where float32 copies of the whole tree would not fit).

The sequence: the global norm of the unscaled gradients (summed across devices by `total`
where each holds a part, e.g. a pipeline stage's) decides everything. A non-finite norm (an
inf or NaN anywhere, or a sum of squares beyond float32) skips the step: params and
optimizer state stay bit-identical and the loss scale counts it. Otherwise gradients are
unscaled and clipped to `max_norm` with that norm (`optax.clip_by_global_norm`'s
arithmetic), the optimizer runs in float32, and 16-bit results are stochastically rounded.

How a step is skipped is the `Apply`'s. `whole_tree` runs the optimizer in a `lax.cond` on
`finite`: a select of new against old values reads each old leaf after its new value is
computed, and XLA:CPU then copies every donated optimizer-state leaf to write it
(tests/planner/test_xla_copies.py). `per_layer` selects strip by strip inside its loops,
where a cond around the loops would copy the loop-carried trees instead; the packed stages'
update (`jaxpod.engine.packed`) keeps its select too (with a cond XLA:CPU held more of that
update at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpod.config import PrecisionConfig
from jaxpod.optim.chains import clip_by_norm
from jaxpod.optim.precision import (
    LossScaleState,
    apply_updates,
    cast_tree_like,
    sum_squares,
    to_float32,
    unscale_grads,
    update_loss_scale,
)

# (ready, finite, grads, opt_state, params, key) -> (params, opt_state, sum of squares of the
# updates); `ready(g)` unscales and clips any part of the gradients, `finite` says whether
# the step is taken (with False the old params and state are returned, bit for bit, and 0).
Apply = Callable[..., tuple[Any, Any, jax.Array]]


def unscaled_sum_squares(grads, loss_scale: LossScaleState) -> jax.Array:
    """f32[]: the sum of squares of the unscaled gradients."""
    return sum_squares(unscale_grads(grads, loss_scale))


def guarded_update(
    apply: Apply,
    grads,
    opt_state,
    params,
    loss_scale: LossScaleState,
    key: jax.Array,
    cfg: PrecisionConfig,
    *,
    max_norm: float,
    grad_sum_squares: Callable = unscaled_sum_squares,
    total: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[Any, Any, LossScaleState, dict[str, jax.Array]]:
    """One optimizer step under the precision policy (module docstring).

    `grads` are gradients of `loss * loss_scale.scale` (any float dtype); `params` in the
    master dtype; `key` the step's key; `max_norm` > 0 clips. Returns `(params, opt_state,
    loss_scale, info)` with `info = {"finite": bool[], "grad_norm": f32[] (of the unscaled,
    unclipped gradients), "update_sq": f32[] (sum of squares of the applied updates, 0 when
    skipped)}`."""
    sq = grad_sum_squares(grads, loss_scale)
    norm = jnp.sqrt(sq if total is None else total(sq))
    finite = jnp.isfinite(norm)

    def ready(g):
        g32 = unscale_grads(g, loss_scale)
        return clip_by_norm(g32, norm, max_norm) if max_norm > 0 else g32

    params, opt_state, update_sq = apply(ready, finite, grads, opt_state, params, key)
    loss_scale = update_loss_scale(loss_scale, finite, cfg)
    return (
        params,
        opt_state,
        loss_scale,
        {"finite": finite, "grad_norm": norm, "update_sq": update_sq},
    )


def whole_tree(optimizer: optax.GradientTransformation) -> Apply:
    """Apply `optimizer` (which must not clip) to float32 upcasts of the whole tree; new
    params via `apply_updates` (key `fold_in(key, 0)`), state leaves back to their dtypes
    (`fold_in(key, 1)`). A skipped step (`finite` False) returns the old trees in a
    `lax.cond`'s other branch (module docstring); `finite` is the global norm's, the same on
    every device, so every device takes the same branch."""

    def apply(ready, finite, grads, opt_state, params, key):
        def step():
            updates, state32 = optimizer.update(
                ready(grads), to_float32(opt_state), to_float32(params)
            )
            new_params = apply_updates(params, updates, jax.random.fold_in(key, 0))
            new_state = cast_tree_like(state32, opt_state, jax.random.fold_in(key, 1))
            return new_params, new_state, sum_squares(updates)

        keep = lambda: (params, opt_state, jnp.zeros((), jnp.float32))  # noqa: E731
        return jax.lax.cond(finite, step, keep)

    return apply

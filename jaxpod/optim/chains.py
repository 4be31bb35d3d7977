"""Optimizers as optax chains: SGD with momentum, AdamW, LAMB or LARS, a learning-rate
schedule (constant, cosine or polynomial) with linear warm-up, and global-norm clipping.

Weight decay and the LARS/LAMB trust ratio apply where the parameters' role masks say
(`jaxpod.models.params.masks`: not to biases and norm scales). Stacked layer parameters
`[L, ...]` get per-layer trust ratios (`scale_by_layerwise_trust_ratio`), exactly as if each
layer were a separate leaf.

The engine clips outside the chain (`clip_by_norm` with the global norm the guarded update
computes, summed across devices where each holds a part), so it builds the chain with
`clip=False`; `clip=True` prepends `optax.clip_by_global_norm` for plain single-device use.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpod.config import OptimConfig
from jaxpod.optim.precision import to_float32

__all__ = [
    "LAMB_EPS",
    "clip_by_norm",
    "lamb",
    "lars",
    "make_optimizer",
    "scale_by_layerwise_trust_ratio",
    "schedule",
]

LAMB_EPS = 1e-6  # Adam epsilon of LAMB (optax.lamb's default)
MaskOrFn = Any  # bool, a pytree of bools (a prefix of the params), or params -> such a pytree


def _resolve(mask: MaskOrFn, params) -> Any:
    """A bool / prefix pytree / callable mask -> a full pytree of bools like `params`."""
    if callable(mask):
        mask = mask(params)
    if isinstance(mask, bool):
        return jax.tree.map(lambda _: mask, params)
    return jax.tree.map(lambda m, p: jax.tree.map(lambda _: m, p), mask, params)


def _layer_sum_squares(x: jax.Array, stacked: bool) -> jax.Array:
    """Sum of squares over all axes (a scalar), or over all but the leading one
    (`[L, 1, ..., 1]`): partial sums over strips of a tensor add up."""
    if stacked and x.ndim >= 1:
        return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)), keepdims=True)
    return jnp.sum(jnp.square(x))


def _layer_norm(x: jax.Array, stacked: bool) -> jax.Array:
    """L2 norm over all axes (a scalar), or over all but the leading one (`[L, 1, ..., 1]`)."""
    return jnp.sqrt(_layer_sum_squares(x, stacked))


def scale_by_layerwise_trust_ratio(
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    mask: MaskOrFn = True,
    stacked: MaskOrFn = False,
) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_trust_ratio` (min_norm 0), masked and per layer for stacked leaves.

    For each leaf where `mask` is True: `u * trust_coefficient * |p| / (|u| + eps)`, or `u`
    unchanged when `|p| == 0` or `|u| == 0`. Where `stacked` is True the leaf is `[L, ...]`
    and the norms (and so the ratio) are per layer `l`, over `p[l]` and `u[l]`: the result
    equals applying the unstacked transform to each slice. Leaves where `mask` is False pass
    through. `mask`/`stacked`: bool, pytree of bools, or a function of the params.

    Two extra arguments (passed through `optax.chain`) let a caller update a leaf in strips
    (`jaxpod.optim.per_layer`), whose ratio needs the norms of the whole leaf: `trust_probe`, a
    dict the transform fills with `{leaf index: (|p|², |u|²)}` of this call's leaves (flat
    order of `jax.tree.leaves(params)`, masked leaves only; updates pass through unscaled),
    and `trust_norms`, `{leaf index: (|p|, |u|)}` to use instead of this call's norms."""

    def update_fn(updates, state, params=None, *, trust_probe=None, trust_norms=None, **_):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs params: update(g, s, params)")
        masks, stack = _resolve(mask, params), _resolve(stacked, params)
        given = trust_norms or {}
        u_leaves, u_def = jax.tree.flatten(updates)
        rows = zip(
            u_leaves,
            jax.tree.leaves(params),
            jax.tree.leaves(masks),
            jax.tree.leaves(stack),
            strict=True,
        )
        out = []
        for n, (u, p, m, s) in enumerate(rows):
            if not m:
                out.append(u)
                continue
            if trust_probe is not None:
                trust_probe[n] = (_layer_sum_squares(p, s), _layer_sum_squares(u, s))
                out.append(u)
                continue
            p_norm, u_norm = given.get(n) or (_layer_norm(p, s), _layer_norm(u, s))
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            zero = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
            out.append(u * jnp.where(zero, jnp.array(1.0, p.dtype), ratio))
        return jax.tree.unflatten(u_def, out), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def lars(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    momentum: float = 0.9,
    eps: float = 0.0,
    nesterov: bool = False,
    mask: MaskOrFn = True,
    stacked: MaskOrFn = False,
) -> optax.GradientTransformation:
    """`optax.lars` with per-layer trust ratios for stacked leaves. `mask` selects the leaves
    that get weight decay *and* the trust ratio (optax's weight_decay_mask and
    trust_ratio_mask); the others get plain SGD with momentum. Same chain as optax:
    decay -> trust ratio -> learning rate -> momentum (the trace holds lr-scaled updates)."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=mask),
        scale_by_layerwise_trust_ratio(trust_coefficient, eps, mask=mask, stacked=stacked),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum, nesterov=nesterov),
    )


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = LAMB_EPS,
    weight_decay: float = 0.0,
    mask: MaskOrFn = True,
    stacked: MaskOrFn = False,
) -> optax.GradientTransformation:
    """`optax.lamb` with per-layer trust ratios for stacked leaves and the trust ratio masked
    like the weight decay (optax.lamb applies its trust ratio to every leaf; with `mask=True`
    this is exactly optax.lamb). Adam -> decay -> trust ratio (coefficient 1) -> lr."""
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=0.0),
        optax.add_decayed_weights(weight_decay, mask=mask),
        scale_by_layerwise_trust_ratio(1.0, 0.0, mask=mask, stacked=stacked),
        optax.scale_by_learning_rate(learning_rate),
    )


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps`, then over the remaining steps `constant`,
    `cosine` decay to 0, or `polynomial` decay `end_lr + (lr - end_lr) * (1 - t/T) ** power`
    (t counted from the end of warm-up, T = total_steps - warmup, held at end_lr after T)."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    after = {
        "constant": lambda: optax.constant_schedule(cfg.lr),
        "cosine": lambda: optax.cosine_decay_schedule(cfg.lr, decay_steps),
        "polynomial": lambda: optax.polynomial_schedule(
            cfg.lr, cfg.end_lr, cfg.power, transition_steps=decay_steps
        ),
    }[cfg.lr_schedule]()
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """`grads * min(1, max_norm / norm)` for a norm computed by the caller (e.g. across
    pipeline stages). Same arithmetic as `optax.clip_by_global_norm`, so with the global
    norm it is bit-identical to it."""
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(
        lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads
    )


def make_optimizer(
    cfg: OptimConfig,
    total_steps: int,
    *,
    decay_mask: MaskOrFn = True,
    stacked_mask: MaskOrFn = False,
    clip: bool = True,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax chain named by `cfg.name` and its learning-rate schedule.

    `clip=True` (and `grad_clip > 0`) prepends `optax.clip_by_global_norm(grad_clip)`;
    `clip=False` puts `optax.identity()` in its place (same state tree, so either optimizer
    updates the other's state) for callers that clip themselves (`clip_by_norm`). Weight decay
    (all optimizers) and trust ratios (lars, lamb) apply where `decay_mask` is True (the
    role masks: not biases, not norm scales); lars/lamb trust ratios are per layer where
    `stacked_mask` is True. LARS uses `trust_coefficient`; LAMB uses coefficient 1 and Adam
    eps 1e-6 (optax.lamb's)."""
    lr = schedule(cfg, total_steps)
    base = {
        "sgd": lambda: optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
            optax.sgd(lr, momentum=cfg.momentum),
        ),
        "adamw": lambda: optax.adamw(
            lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask
        ),
        "lamb": lambda: lamb(
            lr,
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
            stacked=stacked_mask,
        ),
        "lars": lambda: lars(
            lr,
            weight_decay=cfg.weight_decay,
            trust_coefficient=cfg.trust_coefficient,
            momentum=cfg.momentum,
            mask=decay_mask,
            stacked=stacked_mask,
        ),
    }[cfg.name]()
    if cfg.moments == "float32":
        base = float32_state(base)
    clips = []
    if cfg.grad_clip > 0:
        clips = [optax.clip_by_global_norm(cfg.grad_clip) if clip else optax.identity()]
    return optax.chain(*clips, base), lr


def float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run in float32: its state (moments) is created from float32 params, it sees float32
    grads and params, and its updates are cast back to the grads' dtypes. Same math as `tx`
    on 16-bit leaves, without 16-bit moments (`optim.moments=float32`)."""

    def update(grads, state, params=None):
        as_f32 = None if params is None else to_float32(params)
        updates, state = tx.update(to_float32(grads), state, as_f32)
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(lambda params: tx.init(to_float32(params)), update)

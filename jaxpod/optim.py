"""Optimizers as optax chains: global-norm clipping, SGD with momentum or AdamW, and a
learning-rate schedule with linear warm-up."""

from __future__ import annotations

import optax

from jaxpod.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up over `warmup_steps`, then `constant`, or `cosine` decay to 0 at the end."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    after = {
        "constant": optax.constant_schedule(cfg.lr),
        "cosine": optax.cosine_decay_schedule(cfg.lr, decay_steps),
    }[cfg.schedule]
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def make_optimizer(
    cfg: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax chain named by `cfg.name` and its learning-rate schedule.

    It runs outside `shard_map` on globally sharded arrays, so norms (clipping) are over
    whole parameters, not shards."""
    lr = schedule(cfg, total_steps)
    base = {
        "sgd": lambda: optax.chain(
            optax.add_decayed_weights(cfg.weight_decay), optax.sgd(lr, momentum=cfg.momentum)
        ),
        "adamw": lambda: optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    }[cfg.name]()
    clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*clip, base), lr

"""Pipelines over the `pipeline` mesh axis as one `lax.scan` over a schedule's ticks, inside
`shard_map` (the tables: `jaxpod.parallel.schedules`).

`forward_ticks` runs a forward-only table (GPipe, circular) and returns the last stage's
outputs; the backward pass is the same scan transposed by autodiff (activation gradients go
up the pipe by the transposed `ppermute`). Every device computes on every tick (SPMD), so
bubble ticks are computed and thrown away: the layers' executed / useful FLOPs are
ticks / (V·M). Bubble ticks never reach gradients or statistics: their inputs are replaced
by zeros before the stage runs (whatever the carry holds, NaN included) and their outputs
are masked out.

    gpipe, S = 2, M = 4          circular, S = 2, M = 2, V = 2 (r: virtual stage)
    tick:    0  1  2  3  4       tick:    0    1    2    3    4
    stage 0: m0 m1 m2 m3 --      stage 0: m0r0 m1r0 m0r1 m1r1 --
    stage 1: -- m0 m1 m2 m3      stage 1: --   m0r0 m1r0 m0r1 m1r1

`train_ticks` (`jaxpod.parallel.pipeline_train`) runs tables that hold the backward too (1F1B).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.schedules import FORWARD, Schedule, gpipe


def mine(row: jax.Array, axis: str = "pipeline") -> jax.Array:
    """Inside a tick: this device's entry of a `[stages]` row of a schedule table."""
    return row[jax.lax.axis_index(axis)]


def forward_ticks(
    stage_fn: Callable[[jax.Array, jax.Array], jax.Array],
    xs: jax.Array,
    schedule: Schedule,
    *,
    axis: str = "pipeline",
    bubble_fill: float = 0.0,
    unroll: bool = False,
    skip_bubbles: bool = False,
    saves: Callable | None = None,
) -> jax.Array:
    """Run `stage_fn(x, r)` (this device's stage; `r` which of its virtual stages, traced)
    over the micro-batches `xs[M, *act]` on the ticks of a forward-only `schedule`.

    `xs` is read on stage 0 for a micro-batch's first virtual stage; its later virtual stages
    (circular schedule) take the last stage's output, passed around the ring. Returns `ys[M, *act]`:
    the last stage's final outputs in micro-batch order on the last stage, zeros elsewhere.
    `bubble_fill` is what the carry holds before the first activation arrives (any value,
    tests use NaN, leaves the result and its gradients unchanged); `unroll` unrolls the tick
    loop (FLOP accounting); `skip_bubbles` runs the stage under `lax.cond` on the tick's
    liveness, so a bubble tick computes nothing (forward and backward). The cond is a remat
    unit saving what the stage's layers save (`saves`, a `jax.checkpoint` policy; None:
    everything): a cond's backward would otherwise keep every weight the stage reads once per
    tick (its residuals are the cond's outputs, so the scan cannot hoist the loop-invariant
    ones; tests/planner/test_plan_vs_xla.py)."""
    if schedule.explicit_backward:
        raise ValueError(f"{schedule.kind} holds backward ticks: run it with train_ticks")
    tick, probe = _forward_tick(stage_fn, xs, schedule, axis, skip_bubbles, saves)
    carry = jnp.full(xs.shape[1:], bubble_fill, xs.dtype)
    carry = vary_like(vary_like(carry, xs), probe)
    rows = tuple(
        jnp.asarray(a) for a in (schedule.op, schedule.micro_index, schedule.virtual_stage)
    )
    _, outs = jax.lax.scan(tick, carry, rows, unroll=unroll)
    return _in_micro_batch_order(outs, schedule)


def _forward_tick(
    stage_fn: Callable, xs: jax.Array, schedule: Schedule, axis: str, skip_bubbles: bool, saves
) -> tuple[Callable, jax.ShapeDtypeStruct]:
    """`(tick, probe)` of `forward_ticks`: `tick(carry, row) -> (sent, out)` runs one row of
    the table on this device (its input `xs[m]` on the first stage's first virtual stage,
    else the received `carry`; zeros on a bubble) and sends the output around the ring
    (`ppermute`); `out` is the output where the last stage finishes a micro-batch, else zeros.
    With `skip_bubbles` the stage runs under a `lax.cond` on the tick's liveness, a remat unit
    saving `saves` (`forward_ticks`). `probe`: the type of a stage's output."""
    stages, micro, virtual = schedule.stages, schedule.micro, schedule.virtual
    stage = jax.lax.axis_index(axis)
    ring = [(i, i + 1) for i in range(stages - 1)] + ([(stages - 1, 0)] if virtual > 1 else [])
    last = stages - 1

    def tick(carry, row):
        op, mb, r = (mine(a, axis) for a in row)
        live = op == FORWARD
        first = (stage == 0) & (r == 0)
        x = jnp.where(first, xs[jnp.clip(mb, 0, micro - 1)], carry)
        if skip_bubbles:
            y = skipping(jnp.where(live, x, 0.0), live, r)
        else:
            y = stage_fn(jnp.where(live, x, 0.0), r)
        out = jnp.where(live & (stage == last) & (r == virtual - 1), y, 0.0)
        return jax.lax.ppermute(y, axis, ring), out

    probe = jax.eval_shape(stage_fn, xs[0], jnp.int32(0))
    idle = lambda a: vary_like(jnp.zeros(probe.shape, probe.dtype), probe)  # noqa: E731
    skipping = jax.checkpoint(
        lambda a, live, r: jax.lax.cond(live, lambda a: stage_fn(a, r), idle, a),
        policy=saves or jax.checkpoint_policies.everything_saveable,
    )
    return tick, probe


def _in_micro_batch_order(outs: jax.Array, schedule: Schedule) -> jax.Array:
    """`outs[ticks, *act]` -> `ys[M, *act]`: the ticks on which the last stage finishes each
    micro-batch (static: from the table), in micro-batch order."""
    last, virtual = schedule.stages - 1, schedule.virtual
    final = (schedule.op[:, last] == FORWARD) & (schedule.virtual_stage[:, last] == virtual - 1)
    ticks = np.nonzero(final)[0][np.argsort(schedule.micro_index[final, last], kind="stable")]
    if np.array_equal(ticks, np.arange(last, last + schedule.micro)):
        return outs[last:]  # GPipe: the last M ticks, in order
    return outs[jnp.asarray(ticks)]


def spread_over_stages(ys: jax.Array, axis: str = "pipeline") -> jax.Array:
    """Split the last stage's outputs `ys[N, ...]` (zeros on other stages) over all stages.

    Returns this stage's `[N / S, ...]` slice (a reduce-scatter), so every stage computes an
    equal share of the work that follows the pipe (final norm, output projection, loss)
    instead of the last stage doing it alone.
    """
    return jax.lax.psum_scatter(ys, axis, scatter_dimension=0, tiled=True)


def gpipe_ticks(
    stage_fn: Callable[[jax.Array], jax.Array],
    xs: jax.Array,
    *,
    axis: str = "pipeline",
    bubble_fill: float = 0.0,
    unroll: bool = False,
) -> jax.Array:
    """GPipe of `stage_fn(x)` (no virtual stages) over `xs[M, *act]` (`forward_ticks` of
    `gpipe`)."""
    schedule = gpipe(jax.lax.axis_size(axis), xs.shape[0])
    return forward_ticks(
        lambda x, _: stage_fn(x), xs, schedule, axis=axis, bubble_fill=bubble_fill, unroll=unroll
    )

"""GPipe over the `pipeline` mesh axis as one `lax.scan`, for the inside of `shard_map`.

With S stages and M micro-batches the schedule runs T = M + S - 1 ticks. On tick t, stage s
works on micro-batch t - s; when that index is outside [0, M) the tick is a *bubble*. Every
device computes on every tick (SPMD), so bubbles are computed and thrown away: the executed
over useful FLOP ratio of the layers is (M + S - 1) / M. Activations move one stage down the
pipe per tick with a `ppermute`. The backward pass is the same scan transposed by autodiff
(activation gradients flow up the pipe by the transposed `ppermute`).

Bubble ticks never reach gradients or statistics: their inputs are replaced by zeros
before the stage runs (whatever garbage the carry holds, NaN included), and their outputs
are masked out of the result.

    tick:     0    1    2    3    4          (S = 2, M = 4)
    stage 0:  m0   m1   m2   m3   --
    stage 1:  --   m0   m1   m2   m3
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpod.parallel.manual import vary_like


def gpipe(
    stage_fn: Callable[[jax.Array], jax.Array],
    xs: jax.Array,
    *,
    axis: str = "pipeline",
    bubble_fill: float = 0.0,
    unroll: bool = False,
) -> jax.Array:
    """Run `stage_fn` (this device's stage) over the micro-batches `xs[M, *act]`.

    `xs` is read on stage 0 only. Returns `ys[M, *act]`: the last stage's outputs, in
    micro-batch order, on the last stage; zeros on every other stage.
    `bubble_fill` is what the carry holds before the first activation arrives; any value
    (tests use NaN) leaves the result and its gradients unchanged. `unroll` unrolls the
    tick loop (for FLOP accounting).
    """
    num_stages = jax.lax.axis_size(axis)
    num_micro = xs.shape[0]
    stage = jax.lax.axis_index(axis)
    down_the_pipe = [(i, i + 1) for i in range(num_stages - 1)]

    def tick(carry, t):
        x = jnp.where(stage == 0, xs[jnp.minimum(t, num_micro - 1)], carry)
        micro = t - stage
        live = (micro >= 0) & (micro < num_micro)
        y = stage_fn(jnp.where(live, x, 0.0))
        out = jnp.where(live & (stage == num_stages - 1), y, 0.0)
        return jax.lax.ppermute(y, axis, down_the_pipe), out

    probe = jax.eval_shape(stage_fn, xs[0])
    carry = jnp.full(xs.shape[1:], bubble_fill, xs.dtype)
    carry = vary_like(vary_like(carry, xs), probe)
    _, outs = jax.lax.scan(tick, carry, jnp.arange(num_micro + num_stages - 1), unroll=unroll)
    return outs[num_stages - 1 :]


def spread_over_stages(ys: jax.Array, axis: str = "pipeline") -> jax.Array:
    """Split the last stage's outputs `ys[N, ...]` (zeros on other stages) over all stages.

    Returns this stage's `[N / S, ...]` slice (a reduce-scatter), so every stage computes an
    equal share of the work that follows the pipe (final norm, output projection, loss)
    instead of the last stage doing it alone.
    """
    return jax.lax.psum_scatter(ys, axis, scatter_dimension=0, tiled=True)

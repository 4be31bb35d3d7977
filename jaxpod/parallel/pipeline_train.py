"""Pipelines whose table holds the backward too (1F1B), as one `lax.scan` inside `shard_map`.

Each tick a stage runs one op of the table (`lax.switch`: only the live branch executes, so
bubble ticks cost nothing but the tick's two `ppermute`s):

    FORWARD  m: x = embed(inputs[m]) on the first stage, else the activation received from
             the previous stage (kept in a ring buffer of the stage's in-flight inputs);
             y = stage(x), sent down; on the last stage the head's loss and, right away,
             its gradient dL/dy (kept for this stage's backward of m) and the head's own
             parameter gradients
    BACKWARD m: the stage recomputed from its kept input under its remat policy, and its
             `jax.vjp` applied to the gradient received from the next stage: dL/dparams
             added to the carry, dL/dx sent up (on the first stage the vjp reaches the
             embedding's parameters instead)

A stage keeps at most `max(schedule.in_flight)` micro-batches' inputs: memory independent
of M. The loss is scaled (loss scaling) before its gradient seeds the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.pipeline import mine
from jaxpod.parallel.schedules import BACKWARD, FORWARD, Schedule


def receive_slots(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """`[ticks, stages]`: the micro-batch whose activation (first array) / gradient (second)
    arrives at stage s at the start of tick t (sent by stage s-1's forward, s+1's backward,
    on tick t-1), or -1."""
    op, mb = schedule.op, schedule.micro_index
    acts, grads = np.full(op.shape, -1, np.int32), np.full(op.shape, -1, np.int32)
    for t in range(1, op.shape[0]):
        for s in range(schedule.stages):
            if s > 0 and op[t - 1, s - 1] == FORWARD:
                acts[t, s] = mb[t - 1, s - 1]
            if s < schedule.stages - 1 and op[t - 1, s + 1] == BACKWARD:
                grads[t, s] = mb[t - 1, s + 1]
    return acts, grads


def _typed_zeros(like):
    """Zeros shaped like `like` (an array or `ShapeDtypeStruct`), varying like it."""
    return vary_like(jnp.zeros(like.shape, like.dtype), like)


def train_ticks(
    embed: Callable,
    stage: Callable,
    head: Callable,
    params,
    inputs: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None,
    schedule: Schedule,
    *,
    scale: jax.Array,
    axis: str = "pipeline",
    bubble_fill: float = 0.0,
    unroll: bool = False,
):
    """`(loss, aux, grads)` of the micro-batches `inputs/targets/weights[M, ...]` under a
    table with backward ops. `embed(params, inputs[m]) -> x`, `stage(params, x) -> y` (same
    shape), `head(params, y, targets[m], weights[m]) -> (loss, aux)` (the loss already divided
    by its denominator); `grads` are those of `scale * loss`, summed over the micro-batches,
    this device's part (the caller reduces them over the data axes). `bubble_fill`: what the
    buffers and the first tick's received values hold before anything is sent (any value,
    tests use NaN, leaves the results unchanged)."""
    stages, micro = schedule.stages, schedule.micro
    k = int(schedule.in_flight.max())
    index = jax.lax.axis_index(axis)
    is_first, is_last = index == 0, index == stages - 1
    down = [(i, i + 1) for i in range(stages - 1)]
    up = [(i + 1, i) for i in range(stages - 1)]
    at = lambda a, m: a[jnp.clip(m, 0, micro - 1)]  # noqa: E731
    weights_of = lambda m: None if weights is None else at(weights, m)  # noqa: E731

    # The activation's type: the embedding's and every stage output's varying axes together
    # (the branches of a tick must agree on the carry's types).
    act = _typed_zeros(jax.eval_shape(lambda: embed(params, inputs[0])))  # a typed template
    for _ in range(3):
        act = vary_like(act, jax.eval_shape(lambda a=act: stage(params, a)))
    as_act = lambda x: vary_like(x.astype(act.dtype), act)  # noqa: E731
    out0 = jax.eval_shape(lambda: head(params, _typed_zeros(act), targets[0], weights_of(0)))

    def stage_input(p, m, kept):
        return jax.lax.cond(is_first, lambda: as_act(embed(p, at(inputs, m))), lambda: kept)

    def head_and_grads(y, m):
        """(loss, aux, dL/dparams, dL/dy) of micro-batch m's head, the loss scaled."""
        loss_of = lambda p, y: head(p, y, at(targets, m), weights_of(m))  # noqa: E731
        loss, vjp, aux = jax.vjp(loss_of, params, y, has_aux=True)
        dp, dy = vjp(vary_like(scale.astype(loss.dtype), loss))
        return loss, aux, dp, as_act(dy)

    def no_head(y, m):
        dp = jax.tree.map(_typed_zeros, params)
        aux = jax.tree.map(_typed_zeros, out0[1])
        return _typed_zeros(out0[0]), aux, dp, _typed_zeros(act)

    def forward(carry, m):
        acts, grads_in, _, _, acc, loss_sum, aux_sum = carry
        x = stage_input(params, m, acts[m % k])
        acts = acts.at[m % k].set(x)
        y = as_act(stage(params, x))
        loss, aux, dp, dy = jax.lax.cond(is_last, head_and_grads, no_head, y, m)
        grads_in = jnp.where(is_last, grads_in.at[m % k].set(dy), grads_in)
        acc = jax.tree.map(jnp.add, acc, dp)
        aux_sum = jax.tree.map(jnp.add, aux_sum, aux)
        return acts, grads_in, y, _typed_zeros(act), acc, loss_sum + loss, aux_sum

    def backward(carry, m):
        acts, grads_in, _, _, acc, loss_sum, aux_sum = carry
        stage_from_kept = lambda p, kept: as_act(stage(p, stage_input(p, m, kept)))  # noqa: E731
        _, vjp = jax.vjp(stage_from_kept, params, acts[m % k])
        dp, dx = vjp(grads_in[m % k])
        acc = jax.tree.map(jnp.add, acc, dp)
        return acts, grads_in, _typed_zeros(act), as_act(dx), acc, loss_sum, aux_sum

    def idle(carry, m):
        acts, grads_in, _, _, acc, loss_sum, aux_sum = carry
        return acts, grads_in, _typed_zeros(act), _typed_zeros(act), acc, loss_sum, aux_sum

    def tick(state, row):
        carry, (recv_act, recv_grad) = state
        op, m, act_slot, grad_slot = (mine(r, axis) for r in row)
        acts = jnp.where(act_slot >= 0, carry[0].at[act_slot % k].set(recv_act), carry[0])
        grads_in = jnp.where(grad_slot >= 0, carry[1].at[grad_slot % k].set(recv_grad), carry[1])
        out = jax.lax.switch(op, [idle, forward, backward], (acts, grads_in, *carry[2:]), m)
        sent = (jax.lax.ppermute(out[2], axis, down), jax.lax.ppermute(out[3], axis, up))
        return (out, sent), None

    fill = lambda shape: vary_like(jnp.full(shape, bubble_fill, act.dtype), act)  # noqa: E731
    buffer = fill((k, *act.shape))
    carry = (
        buffer,
        buffer,
        _typed_zeros(act),
        _typed_zeros(act),
        jax.tree.map(_typed_zeros, params),
        _typed_zeros(out0[0]),
        jax.tree.map(_typed_zeros, out0[1]),
    )
    acts_in, grads_in = receive_slots(schedule)
    rows = tuple(jnp.asarray(a) for a in (schedule.op, schedule.micro_index, acts_in, grads_in))
    sent = (fill(act.shape), fill(act.shape))
    (carry, _), _ = jax.lax.scan(tick, (carry, sent), rows, unroll=unroll)
    _, _, _, _, grads, loss, aux = carry
    return loss, aux, grads

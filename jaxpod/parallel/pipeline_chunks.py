"""Stage-by-stage schedules over V chunks per device (interleaved 1F1B, ZB-V) as one
`lax.scan` inside `shard_map`.

Like `train_ticks`, each tick a device runs one op of the table under `lax.switch` (FORWARD,
BACKWARD, B, W or nothing) on chunk r of micro-batch m; unlike it, a value may go to either
neighbour or stay on the device (`jaxpod.parallel.chunk_routes`): each tick sends one value
down the ring (to s + 1) and one up (to s - 1), and what a device holds lives in two slot
buffers whose slots the routes assign. The first global stage embeds, the last runs the head
(for ZB-V both are on device 0). With a `StageSplit`, B keeps what each layer's weight
gradients need in a slot (`weight_slots`) and W reads it, as in `train_ticks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.parallel.chunk_routes import routes
from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.pipeline import mine
from jaxpod.parallel.pipeline_train import typed_zeros
from jaxpod.parallel.schedules import BACKWARD, BACKWARD_INPUT, FORWARD, Schedule
from jaxpod.parallel.schedules_split import weight_slots
from jaxpod.parallel.weight_split import StageSplit, no_slot, put_slot, slot_of


class _Carry(NamedTuple):
    """`acts[K, *act]` and `grads[K, *act]`: the kept inputs and the waiting gradients; the
    sums of `grads_sum`, `loss` and `aux`; `held`: B's slots for W with a split
    (`train_ticks`' `_Carry`), or (). Only `_Chunks.tick` writes them, after the switch."""

    acts: jax.Array
    grads: jax.Array
    grads_sum: Any
    loss: jax.Array
    aux: Any
    held: Any


class _Done(NamedTuple):
    """What a tick's op returns, one micro-batch's values, written into the carry after the
    tick's switch (`_Chunks.tick`): `out` sent, and kept at `row.local` (the forward's
    output in `acts`, a backward's dL/dx in `grads`); the forward's input `x` (kept at
    `row.act`) and the head's `dy` (at `row.grad`); `dp`, `loss` and `aux` to add; B's slot
    `held`. A switch that returned the buffers updated would copy them in every branch
    that passes them through."""

    out: jax.Array
    x: jax.Array
    dy: jax.Array
    dp: Any
    loss: jax.Array
    aux: Any
    held: Any


def train_chunk_ticks(
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
    split: StageSplit | None = None,
):
    """`(loss, aux, grads)` as `train_ticks`, with `stage(params, x, r)` running chunk r of
    this device's layers (and `split`'s `r` argument)."""
    ticks = _Chunks(embed, stage, head, params, inputs, targets, weights, schedule, scale, axis)
    act = ticks.act
    fill = lambda shape: vary_like(jnp.full(shape, bubble_fill, act.dtype), act)  # noqa: E731
    buffer = fill((ticks.slots, *act.shape))
    zeros = jax.tree.map(typed_zeros, (params, ticks.out0[0], ticks.out0[1]))
    held, count = (), weight_slots(schedule)[1]
    if split is not None and (schedule.op == BACKWARD_INPUT).any():
        split.prepare(params, act)
        held, ticks.split = (split.held(count, bubble_fill, act), fill((count, *act.shape))), split
    carry = _Carry(buffer, buffer, *zeros, held)
    rows = tuple(jnp.asarray(a) for a in ticks.rows)
    sent = (fill(act.shape), fill(act.shape))
    (carry, _), _ = jax.lax.scan(ticks.tick, (carry, sent), rows, unroll=unroll)
    return carry.loss, carry.aux, carry.grads_sum


def _rows(schedule: Schedule) -> tuple[tuple[np.ndarray, ...], int]:
    """The per-tick tables the scan reads, and the slot count."""
    rt = routes(schedule)
    # what arrives at the start of tick t: the kind the neighbour sent on tick t - 1
    down_kind, up_kind = np.zeros_like(rt.send_down), np.zeros_like(rt.send_up)
    down_kind[1:] = np.roll(rt.send_down[:-1], 1, axis=1)  # from s - 1
    up_kind[1:] = np.roll(rt.send_up[:-1], -1, axis=1)  # from s + 1
    rows = (schedule.op, schedule.micro_index, schedule.virtual_stage, rt.gstage, rt.act)
    rows += (rt.grad, rt.send_down, rt.send_up, down_kind, rt.down_slot, up_kind, rt.up_slot)
    return (*rows, rt.local, np.maximum(weight_slots(schedule)[0], 0)), rt.slots


class _Row(NamedTuple):
    """This device's entries of one tick's tables (`_rows`)."""

    op: jax.Array
    m: jax.Array
    r: jax.Array
    g: jax.Array
    act: jax.Array
    grad: jax.Array
    send_down: jax.Array
    send_up: jax.Array
    down_kind: jax.Array
    down_slot: jax.Array
    up_kind: jax.Array
    up_slot: jax.Array
    local: jax.Array
    held: jax.Array


class _Chunks:
    """One `train_chunk_ticks` call: its arguments, the tables, the typed templates (`act`,
    the head's `out0`) and the ops. `tick` is the scan's body."""

    def __init__(self, embed, stage, head, params, inputs, targets, weights, schedule, scale, axis):
        self.embed, self.stage, self.head, self.params = embed, stage, head, params
        self.inputs, self.targets, self.weights = inputs, targets, weights
        self.scale, self.axis = scale, axis
        self.split: StageSplit | None = None
        self.stages, self.micro = schedule.stages, schedule.micro
        self.last = schedule.stages * schedule.virtual - 1
        self.rows, self.slots = _rows(schedule)
        act = typed_zeros(jax.eval_shape(lambda: embed(params, inputs[0])))
        for _ in range(3):
            act = vary_like(act, jax.eval_shape(lambda a=act: stage(params, a, 0)))
        self.act = act
        w0 = None if weights is None else weights[0]
        self.out0 = jax.eval_shape(lambda: head(params, typed_zeros(act), targets[0], w0))

    def at(self, a, m):
        return a[jnp.clip(m, 0, self.micro - 1)]

    def as_act(self, x):
        return vary_like(x.astype(self.act.dtype), self.act)

    def stage_of(self, p, kept, row: _Row):
        """The op's chunk run on its input: embedded at the first global stage, else kept."""
        embedded = lambda: self.as_act(self.embed(p, self.at(self.inputs, row.m)))  # noqa: E731
        x = jax.lax.cond(row.g == 0, embedded, lambda: kept)
        return self.as_act(self.stage(p, x, row.r))

    def head_grads(self, y, row: _Row):
        """(loss, aux, dL/dparams, dL/dy) of the head on micro-batch m, the loss scaled."""
        w = None if self.weights is None else self.at(self.weights, row.m)
        fn = lambda p, y: self.head(p, y, self.at(self.targets, row.m), w)  # noqa: E731
        loss, vjp, aux = jax.vjp(fn, self.params, y, has_aux=True)
        dp, dy = vjp(vary_like(self.scale.astype(loss.dtype), loss))
        return loss, aux, dp, self.as_act(dy)

    def no_head(self, y, row: _Row):
        zeros = jax.tree.map(typed_zeros, (self.out0[0], self.out0[1], self.params))
        return zeros[0], zeros[1], zeros[2], typed_zeros(self.act)

    def done(self, c: _Carry, out=None, **values) -> _Done:
        """An op's `_Done`: zeros (B's slot `no_slot`) where it leaves `values` out."""
        zero = typed_zeros(self.act)
        loss, aux, dp = jax.tree.map(typed_zeros, (self.out0[0], self.out0[1], self.params))
        out = zero if out is None else out
        return _Done(out, zero, zero, dp, loss, aux, no_slot(c.held))._replace(**values)

    def forward(self, c: _Carry, row: _Row) -> _Done:
        """The chunk's input kept (embedded at the first global stage), its output sent or
        handed to this device's next chunk; at the last global stage the head."""
        x = jax.lax.cond(
            row.g == 0,
            lambda: self.as_act(self.embed(self.params, self.at(self.inputs, row.m))),
            lambda: c.acts[row.act],
        )
        y = self.as_act(self.stage(self.params, x, row.r))
        loss, aux, dp, dy = jax.lax.cond(row.g == self.last, self.head_grads, self.no_head, y, row)
        return self.done(c, y, x=x, dy=dy, dp=dp, loss=loss, aux=aux)

    def backward(self, c: _Carry, row: _Row, inputs: bool, weights: bool) -> _Done:
        """The chunk's vjp from its kept input and gradient: with respect to its input
        (`inputs`: dL/dx sent or handed on) and/or its parameters (`weights`: added)."""
        if self.split is not None and inputs != weights:
            return self.split_input(c, row) if inputs else self.split_weight(c, row)
        kept, dy = c.acts[row.act], c.grads[row.grad]
        _, vjp = jax.vjp(lambda p, x: self.stage_of(p, x, row), self.params, kept)
        dp, dx = vjp(dy)
        done = self.done(c, self.as_act(dx) if inputs else None)
        return done._replace(dp=dp) if weights else done

    def split_input(self, c: _Carry, row: _Row) -> _Done:
        """B with a split: the chunk with probes, its vjp with respect to its input and the
        probes; saved operands, cotangents and dL/dx returned to be kept in slot `row.held`,
        dL/dx sent or handed on."""
        p, split = self.params, self.split
        embedded = lambda: self.as_act(self.embed(p, self.at(self.inputs, row.m)))  # noqa: E731
        x = jax.lax.cond(row.g == 0, embedded, lambda: c.acts[row.act])
        fn = lambda x, z: (lambda ys: (self.as_act(ys[0]), ys[1]))(split.forward(p, x, z, row.r))  # noqa: E731
        _, vjp, saved = jax.vjp(fn, x, split.probes(), has_aux=True)
        dx, cts = vjp(c.grads[row.grad])
        dx = self.as_act(dx)
        held = jax.tree.map(lambda b, v: vary_like(v, b), c.held, ((saved, cts), dx))
        return self.done(c, dx, held=held)

    def split_weight(self, c: _Carry, row: _Row) -> _Done:
        """W with a split: the chunk's parameter gradients from slot `row.held`, and at
        the first global stage the embedding's."""
        (saved, cts), dx = slot_of(c.held, row.held)
        dp = self.split.weights(self.params, saved, cts, row.r)
        embedding = lambda p: self.as_act(self.embed(p, self.at(self.inputs, row.m)))  # noqa: E731
        first = lambda: jax.vjp(embedding, self.params)[1](dx)[0]  # noqa: E731
        zeros = lambda: jax.tree.map(typed_zeros, self.params)  # noqa: E731
        return self.done(c, dp=jax.tree.map(jnp.add, dp, jax.lax.cond(row.g == 0, first, zeros)))

    def tick(self, state, table_row):
        """Store what arrived, run this device's op (`lax.switch` over the table's ops, each
        returning a `_Done`), keep its values, send its output down or up."""
        c, (from_prev, from_next) = state
        row = _Row(*(mine(a, self.axis) for a in table_row))
        acts = put_slot(c.acts, row.down_slot, from_prev, row.down_kind == 1)
        grads = put_slot(c.grads, row.down_slot, from_prev, row.down_kind == 2)
        acts = put_slot(acts, row.up_slot, from_next, row.up_kind == 1)
        c = c._replace(acts=acts, grads=put_slot(grads, row.up_slot, from_next, row.up_kind == 2))
        ops = [
            lambda c, row: self.done(c),
            self.forward,
            lambda c, row: self.backward(c, row, True, True),
            lambda c, row: self.backward(c, row, True, False),
            lambda c, row: self.backward(c, row, False, True),
        ]
        used = sorted({0, *np.unique(self.rows[0]).tolist()})  # only the table's ops
        branch_of = np.zeros(5, np.int32)
        branch_of[used] = np.arange(len(used))
        done = jax.lax.switch(jnp.asarray(branch_of)[row.op], [ops[o] for o in used], c, row)
        c = self.keep(c, row, done)
        zero, n = typed_zeros(self.act), self.stages
        ring = lambda send, by: jax.lax.ppermute(  # noqa: E731
            jnp.where(send > 0, done.out, zero), self.axis, [(i, (i + by) % n) for i in range(n)]
        )
        return (c, (ring(row.send_down, 1), ring(row.send_up, -1))), None

    def keep(self, c: _Carry, row: _Row, done: _Done) -> _Carry:
        """The carry with a tick's `done` written in place (`put_slot`) and added."""
        forward, kept = row.op == FORWARD, row.local >= 0
        backward = (row.op == BACKWARD) | (row.op == BACKWARD_INPUT)
        acts = put_slot(c.acts, row.act, done.x, forward)
        acts = put_slot(acts, row.local, done.out, forward & kept)
        grads = put_slot(c.grads, row.grad, done.dy, forward & (row.g == self.last))
        grads = put_slot(grads, row.local, done.out, backward & kept)
        return _Carry(
            acts,
            grads,
            jax.tree.map(jnp.add, c.grads_sum, done.dp),
            c.loss + done.loss,
            jax.tree.map(jnp.add, c.aux, done.aux),
            put_slot(c.held, row.held, done.held, row.op == BACKWARD_INPUT),
        )

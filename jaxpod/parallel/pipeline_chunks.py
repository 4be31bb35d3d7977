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
from jaxpod.parallel.schedules import BACKWARD_INPUT, Schedule
from jaxpod.parallel.schedules_split import weight_slots
from jaxpod.parallel.weight_split import StageSplit, no_slot, put_slot, slot_of


class _Carry(NamedTuple):
    """`acts[K, *act]` and `grads[K, *act]`: the kept inputs and the waiting gradients;
    `out`: what this tick's op sends; the sums of `grads_sum`, `loss` and `aux`; `held`:
    B's slots for W with a split (`train_ticks`' `_Carry`), or (); a tick's switch returns
    one slot's values in their place (`branch`)."""

    acts: jax.Array
    grads: jax.Array
    out: jax.Array
    grads_sum: Any
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
    carry = _Carry(buffer, buffer, typed_zeros(act), *zeros, held)
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

    def forward(self, c: _Carry, row: _Row) -> _Carry:
        """The chunk's input kept (embedded at the first global stage), its output sent or
        handed to this device's next chunk; at the last global stage the head."""
        x = jax.lax.cond(
            row.g == 0,
            lambda: self.as_act(self.embed(self.params, self.at(self.inputs, row.m))),
            lambda: c.acts[row.act],
        )
        acts = c.acts.at[row.act].set(x)
        y = self.as_act(self.stage(self.params, x, row.r))
        loss, aux, dp, dy = jax.lax.cond(row.g == self.last, self.head_grads, self.no_head, y, row)
        grads = jnp.where(row.g == self.last, c.grads.at[row.grad].set(dy), c.grads)
        acts = jnp.where(row.local >= 0, acts.at[row.local].set(y), acts)
        return _Carry(
            acts,
            grads,
            y,
            jax.tree.map(jnp.add, c.grads_sum, dp),
            c.loss + loss,
            jax.tree.map(jnp.add, c.aux, aux),
            c.held,
        )

    def backward(self, c: _Carry, row: _Row, inputs: bool, weights: bool) -> _Carry:
        """The chunk's vjp from its kept input and gradient: with respect to its input
        (`inputs`: dL/dx sent or handed on) and/or its parameters (`weights`: added)."""
        if self.split is not None and inputs != weights:
            return self.split_input(c, row) if inputs else self.split_weight(c, row)
        kept, dy = c.acts[row.act], c.grads[row.grad]
        _, vjp = jax.vjp(lambda p, x: self.stage_of(p, x, row), self.params, kept)
        dp, dx = vjp(dy)
        dx = self.as_act(dx) if inputs else typed_zeros(self.act)
        grads = jnp.where((row.local >= 0) & inputs, c.grads.at[row.local].set(dx), c.grads)
        total = jax.tree.map(jnp.add, c.grads_sum, dp) if weights else c.grads_sum
        return c._replace(grads=grads, out=dx, grads_sum=total)

    def split_input(self, c: _Carry, row: _Row) -> _Carry:
        """B with a split: the chunk with probes, its vjp with respect to its input and the
        probes; saved operands, cotangents and dL/dx returned to be kept in slot `row.held`
        (`put_slot`), dL/dx sent or handed on."""
        p, split = self.params, self.split
        embedded = lambda: self.as_act(self.embed(p, self.at(self.inputs, row.m)))  # noqa: E731
        x = jax.lax.cond(row.g == 0, embedded, lambda: c.acts[row.act])
        fn = lambda x, z: (lambda ys: (self.as_act(ys[0]), ys[1]))(split.forward(p, x, z, row.r))  # noqa: E731
        _, vjp, saved = jax.vjp(fn, x, split.probes(), has_aux=True)
        dx, cts = vjp(c.grads[row.grad])
        dx = self.as_act(dx)
        grads = jnp.where(row.local >= 0, c.grads.at[row.local].set(dx), c.grads)
        held = jax.tree.map(lambda b, v: vary_like(v, b), c.held, ((saved, cts), dx))
        return c._replace(grads=grads, out=dx, held=held)

    def split_weight(self, c: _Carry, row: _Row) -> _Carry:
        """W with a split: the chunk's parameter gradients from slot `row.held`, and at
        the first global stage the embedding's."""
        (saved, cts), dx = slot_of(c.held, row.held)
        dp = self.split.weights(self.params, saved, cts, row.r)
        embedding = lambda p: self.as_act(self.embed(p, self.at(self.inputs, row.m)))  # noqa: E731
        first = lambda: jax.vjp(embedding, self.params)[1](dx)[0]  # noqa: E731
        zeros = lambda: jax.tree.map(typed_zeros, self.params)  # noqa: E731
        dp = jax.tree.map(jnp.add, dp, jax.lax.cond(row.g == 0, first, zeros))
        total = jax.tree.map(jnp.add, c.grads_sum, dp)
        return c._replace(out=typed_zeros(self.act), grads_sum=total)

    def idle(self, c: _Carry, row: _Row) -> _Carry:
        return c._replace(out=typed_zeros(self.act))

    def branch(self, o: int):
        """Op code `o` as a branch of the tick's switch: B's buffers (`held`) read, one
        slot's values returned in their place, B's to be kept (`put_slot`), the other ops'
        zeros (`no_slot`)."""
        ops = [
            self.idle,
            self.forward,
            lambda c, row: self.backward(c, row, True, True),
            lambda c, row: self.backward(c, row, True, False),
            lambda c, row: self.backward(c, row, False, True),
        ]
        if o == BACKWARD_INPUT:
            return ops[o]
        return lambda c, row: ops[o](c, row)._replace(held=no_slot(c.held))

    def tick(self, state, table_row):
        """Store what arrived, run this device's op, send its output down or up."""
        c, (from_prev, from_next) = state
        row = _Row(*(mine(a, self.axis) for a in table_row))
        c = c._replace(acts=_store(c.acts, from_prev, row.down_kind == 1, row.down_slot))
        c = c._replace(grads=_store(c.grads, from_prev, row.down_kind == 2, row.down_slot))
        c = c._replace(acts=_store(c.acts, from_next, row.up_kind == 1, row.up_slot))
        c = c._replace(grads=_store(c.grads, from_next, row.up_kind == 2, row.up_slot))
        used = sorted({0, *np.unique(self.rows[0]).tolist()})  # only the table's ops
        branch_of = np.zeros(5, np.int32)
        branch_of[used] = np.arange(len(used))
        out = jax.lax.switch(jnp.asarray(branch_of)[row.op], [self.branch(o) for o in used], c, row)
        c = out._replace(held=put_slot(c.held, row.held, out.held, row.op == BACKWARD_INPUT))
        zero = typed_zeros(self.act)
        n = self.stages
        down = jax.lax.ppermute(
            jnp.where(row.send_down > 0, c.out, zero),
            self.axis,
            [(i, (i + 1) % n) for i in range(n)],
        )
        up = jax.lax.ppermute(
            jnp.where(row.send_up > 0, c.out, zero), self.axis, [(i, (i - 1) % n) for i in range(n)]
        )
        return (c, (down, up)), None


def _store(buffer: jax.Array, value: jax.Array, when: jax.Array, slot: jax.Array) -> jax.Array:
    """`buffer` with `value` in `slot` where `when` (a received value of this kind)."""
    return jnp.where(when, buffer.at[jnp.maximum(slot, 0)].set(value), buffer)

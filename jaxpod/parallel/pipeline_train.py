"""Pipelines whose table holds the backward too (1F1B, ZB-H1), as one `lax.scan` inside
`shard_map`. Each tick a stage runs one op of the table (`lax.switch`: only the live branch
executes, so bubble ticks cost nothing but the tick's two `ppermute`s):

    FORWARD  m: x = embed(inputs[m]) on the first stage, else the activation received from
             the previous stage (kept in a ring buffer of the stage's in-flight inputs);
             y = stage(x), sent down; on the last stage the head's loss and, right away,
             its gradient dL/dy and the head's own parameter gradients
    BACKWARD m: the stage recomputed from its kept input under its remat policy, its
             `jax.vjp` applied to the gradient received from the next stage: dL/dparams
             added to the carry, dL/dx sent up (the first stage's reaches the embedding)
    B m:     the backward split (ZB-H1): the vjp with respect to the stage's input only,
             dL/dx sent up; with a `StageSplit` (`jaxpod.parallel.weight_split`) also with
             respect to zero probes at every use of a weight, the uses' operands and
             cotangents kept in a slot (`weight_slots`) until W; without one the input and
             gradient stay kept
    W m:     the weight gradients: from B's slot, each layer's uses alone differentiated
             with respect to the parameters; without a split, the stage's vjp with respect
             to them from the kept input and gradient: dL/dparams added, nothing sent

A stage keeps at most `max(schedule.in_flight)` micro-batches' inputs (until their backward,
or their W): memory independent of M. The loss is scaled before its gradient seeds the
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.pipeline import mine
from jaxpod.parallel.schedules import BACKWARD, BACKWARD_INPUT, FORWARD, Schedule
from jaxpod.parallel.schedules_split import weight_slots
from jaxpod.parallel.weight_split import StageSplit, no_slot, put_slot, slot_of


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
            if s < schedule.stages - 1 and op[t - 1, s + 1] in (BACKWARD, BACKWARD_INPUT):
                grads[t, s] = mb[t - 1, s + 1]
    return acts, grads


def typed_zeros(like):
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
    split: StageSplit | None = None,
):
    """`(loss, aux, grads)` of the micro-batches `inputs/targets/weights[M, ...]` under a
    table with backward ops. `embed(params, inputs[m]) -> x`, `stage(params, x) -> y` (same
    shape), `head(params, y, targets[m], weights[m]) -> (loss, aux)` (the loss already divided
    by its denominator); `grads` are those of `scale * loss`, summed over the micro-batches,
    this device's part (the caller reduces them over the data axes). `bubble_fill`: what the
    buffers and the first tick's received values hold before anything is sent (any value,
    tests use NaN, leaves the results unchanged). `split`: how B and W split a stage's
    backward (None: W recomputes; module docstring)."""
    ticks = _Ticks(embed, stage, head, params, inputs, targets, weights, schedule, scale, axis)
    act = ticks.act
    held_slots, held = weight_slots(schedule), ()
    if split is not None and (schedule.op == BACKWARD_INPUT).any():
        split.prepare(params, act)
        held, ticks.split = split.held(held_slots[1], bubble_fill, act), split
    fill = lambda shape: vary_like(jnp.full(shape, bubble_fill, act.dtype), act)  # noqa: E731
    buffer = fill((ticks.k, *act.shape))
    carry = _Carry(
        buffer,
        buffer,
        typed_zeros(act),
        typed_zeros(act),
        jax.tree.map(typed_zeros, params),
        typed_zeros(ticks.out0[0]),
        jax.tree.map(typed_zeros, ticks.out0[1]),
        (held, fill((held_slots[1], *act.shape)) if held else ()),
    )
    acts_in, grads_in = receive_slots(schedule)
    rows = (schedule.op, schedule.micro_index, acts_in, grads_in, held_slots[0])
    rows = tuple(jnp.asarray(a) for a in rows)
    sent = (fill(act.shape), fill(act.shape))
    (carry, _), _ = jax.lax.scan(ticks.tick, (carry, sent), rows, unroll=unroll)
    return carry.loss, carry.aux, carry.grads


class _Carry(NamedTuple):
    """What a stage carries from tick to tick: `acts[k, *act]` and `grads_in[k, *act]`, ring
    buffers of its in-flight micro-batches' inputs and of the gradients received for their
    backward (slot `m % k`); `y` and `dx`, what this tick sends down (activation) and up
    (gradient); the sums over the micro-batches so far of the parameter `grads`, the `loss`
    and the head's `aux`; `held`, with a split: B's `(saved, cts)` slots and the gradient at
    the stage's input (on the first stage, the embedding's), or (); a tick's switch returns
    one slot's values in their place (`branch`)."""

    acts: jax.Array
    grads_in: jax.Array
    y: jax.Array
    dx: jax.Array
    grads: Any
    loss: jax.Array
    aux: Any
    held: Any


class _Ticks:
    """One `train_ticks` call: its arguments, this stage's place (`is_first`, `is_last`,
    traced from `axis_index`), `k` ring-buffer slots (the most micro-batches in flight on a
    stage), and the types every branch of a tick agrees on: `act`, a typed zero activation
    (the embedding's and every stage output's varying axes together), `out0` the head's
    `(loss, aux)` shapes. `tick` is the scan's body; `forward`, `backward` and `idle` the
    ops of the table (module docstring)."""

    def __init__(self, embed, stage, head, params, inputs, targets, weights, schedule, scale, axis):
        self.embed, self.stage, self.head, self.params = embed, stage, head, params
        self.inputs, self.targets, self.weights = inputs, targets, weights
        self.scale, self.axis = scale, axis
        self.split: StageSplit | None = None
        self.stages, self.micro = schedule.stages, schedule.micro
        self.k = int(schedule.in_flight.max())
        # the ops the table uses, in code order, and each op code's branch among them
        self.used = sorted({0, *np.unique(schedule.op).tolist()})
        self.branch_of = np.zeros(5, np.int32)
        self.branch_of[self.used] = np.arange(len(self.used))
        index = jax.lax.axis_index(axis)
        self.is_first, self.is_last = index == 0, index == self.stages - 1
        act = typed_zeros(jax.eval_shape(lambda: embed(params, inputs[0])))  # a typed template
        for _ in range(3):
            act = vary_like(act, jax.eval_shape(lambda a=act: stage(params, a)))
        self.act = act
        self.out0 = jax.eval_shape(
            lambda: head(params, typed_zeros(act), targets[0], self.weights_of(0))
        )

    def at(self, a: jax.Array, m) -> jax.Array:
        """Micro-batch `m` of `a[M, ...]` (clipped: bubbles read a valid index)."""
        return a[jnp.clip(m, 0, self.micro - 1)]

    def weights_of(self, m):
        """Micro-batch `m` of the weights, or None."""
        return None if self.weights is None else self.at(self.weights, m)

    def as_act(self, x: jax.Array) -> jax.Array:
        """`x` in the activation's dtype and varying axes (`act`)."""
        return vary_like(x.astype(self.act.dtype), self.act)

    def stage_input(self, p, m, kept):
        """The stage's input of micro-batch m: embedded on the first stage, else `kept`."""
        embedded = lambda: self.as_act(self.embed(p, self.at(self.inputs, m)))
        return jax.lax.cond(self.is_first, embedded, lambda: kept)

    def head_and_grads(self, y, m):
        """(loss, aux, dL/dparams, dL/dy) of micro-batch m's head, the loss scaled."""

        def loss_of(p, y):
            return self.head(p, y, self.at(self.targets, m), self.weights_of(m))

        loss, vjp, aux = jax.vjp(loss_of, self.params, y, has_aux=True)
        dp, dy = vjp(vary_like(self.scale.astype(loss.dtype), loss))
        return loss, aux, dp, self.as_act(dy)

    def no_head(self, y, m):
        """`head_and_grads`' zeros, off the last stage."""
        dp = jax.tree.map(typed_zeros, self.params)
        aux = jax.tree.map(typed_zeros, self.out0[1])
        return typed_zeros(self.out0[0]), aux, dp, typed_zeros(self.act)

    def forward(self, carry: _Carry, m, _slot=None) -> _Carry:
        """FORWARD m: the input kept (slot m % k), the stage run and its output sent down;
        on the last stage the head's loss, its gradient dL/dy kept for the backward of m,
        and the head's parameter gradients."""
        acts, grads_in, _, _, acc, loss_sum, aux_sum, _ = carry
        k = self.k
        x = self.stage_input(self.params, m, acts[m % k])
        acts = acts.at[m % k].set(x)
        y = self.as_act(self.stage(self.params, x))
        loss, aux, dp, dy = jax.lax.cond(self.is_last, self.head_and_grads, self.no_head, y, m)
        grads_in = jnp.where(self.is_last, grads_in.at[m % k].set(dy), grads_in)
        acc = jax.tree.map(jnp.add, acc, dp)
        aux_sum = jax.tree.map(jnp.add, aux_sum, aux)
        return _Carry(
            acts, grads_in, y, typed_zeros(self.act), acc, loss_sum + loss, aux_sum, carry.held
        )

    def backward(self, carry: _Carry, m, _slot=None) -> _Carry:
        """BACKWARD m: the stage recomputed from its kept input, its vjp applied to the
        received gradient: dL/dparams added, dL/dx sent up."""
        acts, grads_in, _, _, acc, loss_sum, aux_sum, _ = carry
        k = self.k

        def stage_from_kept(p, kept):
            return self.as_act(self.stage(p, self.stage_input(p, m, kept)))

        _, vjp = jax.vjp(stage_from_kept, self.params, acts[m % k])
        dp, dx = vjp(grads_in[m % k])
        acc = jax.tree.map(jnp.add, acc, dp)
        return carry._replace(y=typed_zeros(self.act), dx=self.as_act(dx), grads=acc)

    def backward_input(self, carry: _Carry, m, slot) -> _Carry:
        """B m: the stage recomputed from its kept input, its vjp with respect to that
        input applied to the received gradient: dL/dx sent up, the parameters untouched."""
        if self.split is not None:
            return self.split_input(carry, m, slot)
        kept = carry.acts[m % self.k]
        _, vjp = jax.vjp(lambda x: self.stage_from_kept(self.params, x, m), kept)
        (dx,) = vjp(carry.grads_in[m % self.k])
        return carry._replace(y=typed_zeros(self.act), dx=self.as_act(dx))

    def backward_weight(self, carry: _Carry, m, slot) -> _Carry:
        """W m: the vjp with respect to the parameters, from the same kept input and
        gradient: dL/dparams added, nothing sent."""
        if self.split is not None:
            dp = self.split_weight(carry, m, slot)
        else:
            kept = carry.acts[m % self.k]
            _, vjp = jax.vjp(lambda p: self.stage_from_kept(p, kept, m), self.params)
            (dp,) = vjp(carry.grads_in[m % self.k])
        grads = jax.tree.map(jnp.add, carry.grads, dp)
        zero = typed_zeros(self.act)
        return carry._replace(y=zero, dx=zero, grads=grads)

    def stage_from_kept(self, p, kept, m):
        """The stage's output of micro-batch m from its kept input (embedded on the first)."""
        return self.as_act(self.stage(p, self.stage_input(p, m, kept)))

    def split_input(self, carry: _Carry, m, slot) -> _Carry:
        """B m with a split: the stage with probes from its input, its vjp with respect to
        the input and the probes; the saved operands, the probes' cotangents and dL/dx
        returned to be kept in `slot` (`put_slot`), dL/dx sent up."""
        p, split = self.params, self.split
        x = self.stage_input(p, m, carry.acts[m % self.k])
        fn = lambda x, z: (lambda ys: (self.as_act(ys[0]), ys[1]))(split.forward(p, x, z))  # noqa: E731
        _, vjp, saved = jax.vjp(fn, x, split.probes(), has_aux=True)
        dx, cts = vjp(carry.grads_in[m % self.k])
        dx = self.as_act(dx)
        held = jax.tree.map(lambda b, v: vary_like(v, b), carry.held, ((saved, cts), dx))
        return carry._replace(y=typed_zeros(self.act), dx=dx, held=held)

    def split_weight(self, carry: _Carry, m, slot):
        """W m's parameter gradients from B's slot: the layers' (`StageSplit.weights`), and
        on the first stage the embedding's, from the gradient at the stage's input."""
        (saved, cts), dx = slot_of(carry.held, slot)
        dp = self.split.weights(self.params, saved, cts)

        def embedding(p):
            return self.as_act(self.embed(p, self.at(self.inputs, m)))

        first = lambda: jax.vjp(embedding, self.params)[1](dx)[0]  # noqa: E731
        zeros = lambda: jax.tree.map(typed_zeros, self.params)  # noqa: E731
        return jax.tree.map(jnp.add, dp, jax.lax.cond(self.is_first, first, zeros))

    def idle(self, carry: _Carry, m, _slot=None) -> _Carry:
        """A bubble: nothing computed, zeros sent."""
        return carry._replace(y=typed_zeros(self.act), dx=typed_zeros(self.act))

    def branch(self, o: int):
        """Op code `o` as a branch of the tick's switch: it reads B's buffers (`held`) and
        returns in their place one slot's values, B's to be kept (`put_slot`), the other
        ops' zeros (`no_slot`)."""
        ops = [self.idle, self.forward, self.backward, self.backward_input, self.backward_weight]
        if o == BACKWARD_INPUT:
            return ops[o]
        return lambda c, m, slot: ops[o](c, m, slot)._replace(held=no_slot(c.held))

    def tick(self, state, row):
        """One row of the table: what arrived stored in its slot, the stage's op
        (`lax.switch`: only the live branch runs), its outputs sent down and up."""
        carry, (recv_act, recv_grad) = state
        k, axis = self.k, self.axis
        op, m, act_slot, grad_slot, slot = (mine(r, axis) for r in row)
        acts = jnp.where(act_slot >= 0, carry.acts.at[act_slot % k].set(recv_act), carry.acts)
        grads_in = jnp.where(
            grad_slot >= 0, carry.grads_in.at[grad_slot % k].set(recv_grad), carry.grads_in
        )
        carry = carry._replace(acts=acts, grads_in=grads_in)
        branch = jnp.asarray(self.branch_of)[op]  # only the table's ops become branches
        slot = jnp.maximum(slot, 0)
        out = jax.lax.switch(branch, [self.branch(o) for o in self.used], carry, m, slot)
        out = out._replace(held=put_slot(carry.held, slot, out.held, op == BACKWARD_INPUT))
        down = [(i, i + 1) for i in range(self.stages - 1)]
        up = [(i + 1, i) for i in range(self.stages - 1)]
        sent = (jax.lax.ppermute(out.y, axis, down), jax.lax.ppermute(out.dx, axis, up))
        return (out, sent), None

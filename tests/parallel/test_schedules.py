"""Pipeline schedules as data, and the executors that run them.

The tables (`jaxpod.parallel.schedules`) are checked for their invariants on a grid of
stages, micro-batches and virtual stages; the executors (`forward_ticks` under autodiff,
`train_ticks` differentiating stage by stage) are checked against a plain loop over the
layers on one device, with a small model (an embedding matrix, tanh layers stacked
`[L, D, D]` and split over `pipeline`, a squared-error head), for every schedule, on 2 and 4
stages and M in {S, 2S, 4S}.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpod.parallel.pipeline import forward_ticks
from jaxpod.parallel.pipeline_chunks import train_chunk_ticks
from jaxpod.parallel.pipeline_train import receive_slots, train_ticks
from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    KINDS,
    layer_order,
    make_schedule,
)

GRID = [(s, m, v) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 12) for v in (1, 2, 3)]


def cases(kind):
    for s, m, v in GRID:
        if kind != "circular" and v > 1:
            continue
        if kind == "circular" and (m % s or v < 2):
            continue
        yield s, m, v


def forward_ticks_of(sched) -> dict[tuple[int, int, int], int]:
    """{(micro-batch, virtual stage, stage): tick} of every forward; each exactly once."""
    out = {}
    for s in range(sched.stages):
        for t, op, m, r in sched.ops(s):
            if op == FORWARD:
                assert (m, r, s) not in out, (m, r, s)
                out[(m, r, s)] = t
    return out


@pytest.mark.parametrize("kind", ["gpipe", "circular"])
def test_forward_tables_visit_every_virtual_stage_once_in_order(kind):
    """Every micro-batch passes every global stage g = r·S + s exactly once, each one tick
    after the previous (the executor hands activations on by one ppermute per tick, with no
    buffer), and the bubble is (S - 1) / (V·M + S - 1)."""
    for s_, m_, v in cases(kind):
        sched = make_schedule(kind, s_, m_, v)
        assert not sched.explicit_backward
        fwd = forward_ticks_of(sched)
        assert len(fwd) == m_ * v * s_
        for m in range(m_):
            ticks = [fwd[(m, g // s_, g % s_)] for g in range(v * s_)]
            assert ticks == list(range(ticks[0], ticks[0] + v * s_)), (kind, s_, m_, v, m)
        assert sched.ticks == v * m_ + s_ - 1
        assert sched.bubble == pytest.approx((s_ - 1) / (v * m_ + s_ - 1))
        assert (sched.op == FORWARD).sum() == m_ * v * s_  # one op per stage and tick


def test_1f1b_table_invariants():
    """Every (micro-batch, stage) forwarded once and then backwarded once; a forward after
    the previous stage's, a backward after the next stage's (the last stage's after its own
    forward); stage s runs min(S - s, M) warm-up forwards, then alternates, and holds at most
    S - s micro-batches; 2(M + S - 1) ticks, bubble (S - 1) / (M + S - 1)."""
    for s_, m_, _ in cases("1f1b"):
        sched = make_schedule("1f1b", s_, m_)
        when = {}
        for s in range(s_):
            ops = sched.ops(s)
            assert [o for _, o, _, _ in ops].count(FORWARD) == m_
            assert [o for _, o, _, _ in ops].count(BACKWARD) == m_
            for t, o, m, _ in ops:
                when[(o, m, s)] = t
            warm = next(i for i, (_, o, _, _) in enumerate(ops) if o == BACKWARD)
            assert warm == min(s_ - s, m_), (s_, m_, s)
            steady = [o for _, o, _, _ in ops][warm : 2 * m_ - warm]
            assert steady == [BACKWARD, FORWARD] * ((len(steady)) // 2)
        for m, s in itertools.product(range(m_), range(s_)):
            assert when[(FORWARD, m, s)] < when[(BACKWARD, m, s)]
            if s > 0:
                assert when[(FORWARD, m, s - 1)] < when[(FORWARD, m, s)]
            if s < s_ - 1:
                assert when[(BACKWARD, m, s + 1)] < when[(BACKWARD, m, s)]
        assert list(sched.in_flight) == [min(s_ - s, m_) for s in range(s_)]
        assert sched.ticks == 2 * (m_ + s_ - 1)
        assert sched.bubble == pytest.approx((s_ - 1) / (m_ + s_ - 1))


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_stepwise_buffers_never_collide(kind):
    """What `train_ticks` keeps per stage (an activation from its arrival until the stage's
    backward of it, or its W; a gradient from its arrival until then) fits in K =
    max(in_flight) slots indexed m % K: the micro-batches held at once are distinct mod K."""
    done = BACKWARD if kind == "1f1b" else BACKWARD_WEIGHT
    for s_, m_, _ in cases("1f1b"):
        sched = make_schedule(kind, s_, m_)
        k = int(sched.in_flight.max())
        acts_in, grads_in = receive_slots(sched)
        for s in range(s_):
            held_acts, held_grads = set(), set()
            for t in range(sched.ticks):
                if acts_in[t, s] >= 0:
                    held_acts.add(int(acts_in[t, s]))
                if grads_in[t, s] >= 0:
                    held_grads.add(int(grads_in[t, s]))
                op, m = sched.op[t, s], int(sched.micro_index[t, s])
                if op == FORWARD:
                    held_acts.add(m)
                for held in (held_acts, held_grads):
                    assert len({x % k for x in held}) == len(held), (s_, m_, s, t, held)
                if op == done:
                    held_acts.discard(m)
                    held_grads.discard(m)
                if op == FORWARD and s == s_ - 1:
                    held_grads.add(m)  # the head's gradient, kept for the next backward


def test_layer_order_is_round_robin():
    """Stage s's contiguous part of the stored stack holds the global stages s, S + s, ...
    in order; a permutation; the identity for V = 1."""
    assert list(layer_order(8, 2, 2)) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert list(layer_order(8, 2, 1)) == list(range(8))
    order = layer_order(24, 4, 3)
    assert sorted(order) == list(range(24))
    per_virtual = 24 // (4 * 3)
    for s in range(4):
        local = order[s * 6 : (s + 1) * 6]
        firsts = local[::per_virtual]  # each virtual stage's first layer
        assert [int(x) // per_virtual for x in firsts] == [r * 4 + s for r in range(3)]


def test_unknown_schedule_is_refused():
    assert set(KINDS) == {"gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"}
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("zb-h2", 2, 4)
    with pytest.raises(ValueError, match="not a multiple of 2 stages"):
        make_schedule("circular", 2, 3, 2)
    assert IDLE == 0


# ------------------------------------------------------------------ the executors vs a loop
D, MB = 8, 2
# float32; the executors sum the same products in another order (per micro-batch, per
# stage): measured max leaf-relative gradient difference 3e-7; bound as for the engine.
TOL = 3e-6


def _model(layers: int, micro: int):
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((D, D)).astype(np.float32) * 0.5,
        "layers": rng.standard_normal((layers, D, D)).astype(np.float32) * 0.5,
        "head": rng.standard_normal((D, D)).astype(np.float32) * 0.5,
    }
    inputs = rng.standard_normal((micro, MB, D)).astype(np.float32)
    targets = rng.standard_normal((micro, MB, D)).astype(np.float32)
    return params, inputs, targets


def _reference(params, inputs, targets):
    """Plain loss of every micro-batch through every layer, and its gradient."""

    def loss(p):
        x = inputs @ p["embed"]
        for w in p["layers"]:
            x = jnp.tanh(x @ w)
        return jnp.sum((x @ p["head"] - targets) ** 2) / targets.size

    return jax.value_and_grad(loss)(params)


def _executor(kind: str, stages: int, micro: int, virtual: int):
    """(fn, args, params, layer order) of one pipelined executor: `fn(*args)` (inside
    `shard_map` over `stages` devices) is its (loss, grads), the layers' in stored order."""
    layers = 2 * stages * virtual
    params, inputs, targets = _model(layers, micro)
    sched = make_schedule(kind, stages, micro, virtual)
    order = layer_order(layers, stages, virtual, kind)
    stored = {**params, "layers": params["layers"][order]}
    mesh = jax.make_mesh((stages,), ("pipeline",), axis_types=(jax.sharding.AxisType.Auto,))
    per_virtual = 2  # layers
    denominator = targets.size

    def stage_of(p, x, r):
        local = jax.lax.dynamic_slice_in_dim(p["layers"], r * per_virtual, per_virtual)
        for i in range(per_virtual):
            x = jnp.tanh(x @ local[i])
        return x

    def head(p, y, t, _w):
        return jnp.sum((y @ p["head"] - t) ** 2) / denominator, {}

    def local(p, inputs, targets):
        p = {
            k: jax.lax.pcast(v, ("pipeline",), to="varying") if k != "layers" else v
            for k, v in p.items()
        }
        if sched.explicit_backward:  # over chunks, or stage by stage on one chunk each
            run, stage = (train_chunk_ticks, stage_of) if virtual > 1 else (train_ticks, None)
            loss, _, grads = run(
                lambda p, x: x @ p["embed"],
                stage or (lambda p, x: stage_of(p, x, 0)),
                head,
                p,
                inputs,
                targets,
                None,
                sched,
                scale=jnp.float32(1.0),
                bubble_fill=float("nan"),
            )
        else:

            def loss_of(p):
                ys = forward_ticks(
                    lambda x, c: stage_of(p, x, c),
                    inputs @ p["embed"],
                    sched,
                    bubble_fill=float("nan"),
                )
                last = jax.lax.axis_index("pipeline") == stages - 1
                return jnp.where(last, head(p, ys, targets, None)[0], 0.0)

            loss, grads = jax.value_and_grad(loss_of)(p)
        grads = {k: jax.lax.psum(v, "pipeline") if k != "layers" else v for k, v in grads.items()}
        return jax.lax.psum(loss, "pipeline"), grads

    specs = {"embed": P(), "layers": P("pipeline"), "head": P()}
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs))
    return fn, (stored, inputs, targets), (params, inputs, targets), order


@functools.cache
def _pipelined_on(stages: int) -> dict:
    """{(kind, micro): (loss, grads in the logical layer order, the plain loop's (loss,
    grads))} of every executor case on `stages` devices, the executors compiled as one
    program (each its own `shard_map` on its own inputs: one compile instead of nine), the
    plain loops as another."""
    cases = [(k, m, v) for k, s, m, v in EXECUTOR_CASES if s == stages]
    built = [_executor(k, stages, m, v) for k, m, v in cases]
    fns = [fn for fn, *_ in built]
    run_all = jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args, strict=True)])
    outs = run_all([args for _, args, _, _ in built])
    # the plain loops: one single-device program of their own
    wants = jax.jit(lambda plains: [_reference(*p) for p in plains])([p for *_, p, _ in built])
    results = {}
    for (kind, micro, _), (*_, order), (loss, grads), want in zip(
        cases, built, outs, wants, strict=True
    ):
        grads = {**grads, "layers": np.asarray(grads["layers"])[np.argsort(order)]}
        results[(kind, micro)] = loss, grads, want
    return results


def _pipelined(kind: str, stages: int, micro: int, virtual: int):
    """(loss, grads, the plain loop's (loss, grads)) of the `kind` executor, S = `stages`,
    M = `micro`, V = `virtual` (computed with the other cases of S: `_pipelined_on`)."""
    assert (kind, stages, micro, virtual) in EXECUTOR_CASES
    return _pipelined_on(stages)[(kind, micro)]


EXECUTOR_CASES = [
    (kind, s, m, v)
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("circular", 2))
    + (("interleaved-1f1b", 2), ("zb-v", 2))
    for s in (2, 4)
    for m in (s, 2 * s, 4 * s)
]


@pytest.mark.parametrize(
    ("kind", "stages", "micro", "virtual"),
    EXECUTOR_CASES,
    ids=[f"{k}-S{s}-M{m}" for k, s, m, _ in EXECUTOR_CASES],
)
def test_executor_equals_the_plain_loop(kind, stages, micro, virtual):
    """Loss and every gradient (embedding, each layer, head) of the pipelined executor ==
    the plain loop on one device; the pipeline carry and buffers start as NaN (bubbles
    never reach a result)."""
    loss, grads, (want_loss, want) = _pipelined(kind, stages, micro, virtual)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for name in want:
        got, ref = np.asarray(grads[name], np.float64), np.asarray(want[name], np.float64)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        assert err <= TOL, (name, err)

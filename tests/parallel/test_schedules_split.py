"""The tables past 1F1B (`jaxpod.parallel.schedules_split`): interleaved 1F1B, ZB-H1, ZB-V.

On a grid of stages and micro-batches: every op of every (micro-batch, global stage) once, on
the device that holds that global stage; each after what it needs; the in-flight bounds; the
tick counts; and their cost in time units (`jaxpod.parallel.schedule_time`) against GPipe,
circular and 1F1B: in the MPMD ideal interleaved 1F1B's bubble is circular's, ZB-H1's a third
of 1F1B's, and with F, B and W one unit each the lockstep program costs what the ideal does.
"""

from __future__ import annotations

import itertools

import pytest

from jaxpod.parallel.schedule_time import bubble, lockstep_time, mpmd_time, work
from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    TABLES,
    global_stage,
    make_schedule,
    needs,
)

SPLIT = {"interleaved-1f1b": (2, 3), "zb-h1": (1,), "zb-v": (2,)}  # kind -> virtual stages
GRID = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 12)]


def cases(kind):
    for (s, m), v in itertools.product(GRID, SPLIT[kind]):
        if kind == "interleaved-1f1b" and m % s:
            continue
        yield s, m, v


def done_at(sched) -> dict[tuple[int, int, int], int]:
    """{(op, micro-batch, global stage): tick} of every op; each exactly once."""
    out = {}
    for s in range(sched.stages):
        for t, op, m, r in sched.ops(s):
            key = (op, m, global_stage(sched.kind, s, r, sched.stages))
            assert key not in out, key
            out[key] = t
    return out


@pytest.mark.parametrize("kind", list(SPLIT))
def test_every_op_once_after_what_it_needs(kind):
    backward = (BACKWARD,) if kind == "interleaved-1f1b" else (BACKWARD_INPUT, BACKWARD_WEIGHT)
    for s_, m_, v in cases(kind):
        sched = make_schedule(kind, s_, m_, v)
        when = done_at(sched)
        want = {(o, m, g) for o in (FORWARD, *backward) for m in range(m_) for g in range(s_ * v)}
        assert set(when) == want, (kind, s_, m_, v)
        for s in range(s_):  # each device runs the global stages it holds, V of them
            held = {global_stage(kind, s, r, s_) for _, _, _, r in sched.ops(s)}
            assert len(held) == v, (kind, s_, m_, v, s)
            for t, o, m, r in sched.ops(s):
                need = needs(kind, o, m, r, s, s_, v)
                assert need is None or when[need] < t, (kind, s_, m_, v, s, t)


def test_the_v_shape_and_the_round_robin():
    """ZB-V: device s holds global stages s and 2S - 1 - s (device 0 the first and the last);
    interleaved: s, S + s, ..."""
    v_shape = [global_stage("zb-v", s, r, 4) for r in (0, 1) for s in range(4)]
    assert v_shape == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [global_stage("interleaved-1f1b", 1, r, 4) for r in range(3)] == [1, 5, 9]


@pytest.mark.parametrize("kind", list(SPLIT))
def test_ticks_and_what_is_held(kind):
    """Interleaved 1F1B: 2·V·M + 2(S - 1) ticks, Megatron's warm-up plus one chunk in flight.
    ZB-H1 and ZB-V (F, B, W a tick each): 3·V·M + S - 1 ticks once M >= S, and 1F1B's most
    in flight: S micro-batches on every stage (ZB-V: 2S chunks of half a stage)."""
    for s_, m_, v in cases(kind):
        sched = make_schedule(kind, s_, m_, v)
        held = [int(x) for x in sched.in_flight]
        if kind == "interleaved-1f1b":
            assert sched.ticks == 2 * v * m_ + 2 * (s_ - 1)
            assert held == [min((s_ - s - 1) * 2 + (v - 1) * s_ + 1, m_ * v) for s in range(s_)]
            continue
        if m_ >= s_:
            assert sched.ticks == 3 * v * m_ + s_ - 1, (kind, s_, m_)
        most = int(make_schedule("1f1b", s_, m_).in_flight.max())
        assert max(held) == most * v, (kind, s_, m_, held)


def test_bubbles_against_the_schedules_they_improve():
    """In the MPMD ideal: interleaved 1F1B's bubble is circular's, (S - 1) / (V·M + S - 1);
    ZB-H1 idles S - 1 units against 1F1B's 3(S - 1). In lockstep, where a tick costs its
    slowest op, 1F1B and interleaved 1F1B pay for mixing forwards with whole backwards;
    the split schedules, all of whose ops cost one unit, pay nothing."""
    for s_, m_ in [(2, 4), (4, 8), (4, 16)]:
        one = make_schedule("1f1b", s_, m_)
        zb = make_schedule("zb-h1", s_, m_)
        assert mpmd_time(one) - work(one) == 3 * (s_ - 1)
        assert mpmd_time(zb) - work(zb) == s_ - 1
        inter, circ = (
            make_schedule("interleaved-1f1b", s_, m_, 2),
            make_schedule("circular", s_, m_, 2),
        )
        assert bubble(inter, mpmd_time(inter)) == pytest.approx(bubble(circ, mpmd_time(circ)))
        assert bubble(circ, mpmd_time(circ)) == pytest.approx((s_ - 1) / (2 * m_ + s_ - 1))
        for kind, v in (("zb-h1", 1), ("zb-v", 2)):
            sched = make_schedule(kind, s_, m_, v)
            assert lockstep_time(sched) == mpmd_time(sched)
        assert lockstep_time(one) > mpmd_time(one)
        assert lockstep_time(inter) > mpmd_time(inter)


def test_every_table_kind_is_built():
    assert set(TABLES) == {"gpipe", "circular", "1f1b", *SPLIT}
    with pytest.raises(ValueError, match="not a multiple"):
        make_schedule("interleaved-1f1b", 4, 6, 2)


def plain_greedy(kind: str, stages: int, micro: int, virtual: int, cap: int) -> list[list]:
    """`greedy` the plain way: every op not yet run is a candidate on every tick."""
    from jaxpod.parallel.schedules_split import _pick

    kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    every = [(o, m, r) for o in kinds for m in range(micro) for r in range(virtual)]
    todo, done, held, rows = [set(every) for _ in range(stages)], {}, [0] * stages, []
    while any(todo):
        t, row = len(rows), []
        for s in range(stages):
            ready = [
                op
                for op in todo[s]
                if (need := needs(kind, *op, s, stages, virtual)) is None or done.get(need, t) < t
            ]
            pick = _pick(kind, s, stages, ready, held[s] < cap)
            row.append(pick or (IDLE, -1, 0))
            if pick:
                todo[s].discard(pick)
                held[s] += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(pick[0], 0)
        for s, (o, m, r) in enumerate(row):
            if m >= 0:
                done[(o, m, global_stage(kind, s, r, stages))] = t
        rows.append(row)
    return rows


@pytest.mark.parametrize(("stages", "micro"), [(1, 3), (2, 5), (3, 7), (4, 12), (5, 9)])
def test_greedy_looks_only_at_each_lanes_next_op(stages, micro):
    """ZB-V's greedy, which looks at the next micro-batch of each (op, virtual stage) only,
    builds the table the plain greedy over every op not yet run builds."""
    sched = make_schedule("zb-v", stages, micro, 2)
    rows = plain_greedy("zb-v", stages, micro, 2, 2 * stages)
    assert sched.op.shape == (len(rows), stages)
    for t, row in enumerate(rows):
        for s, (o, m, r) in enumerate(row):
            got = (sched.op[t, s], sched.micro_index[t, s], sched.virtual_stage[t, s])
            assert got == (o, m, r), (t, s)

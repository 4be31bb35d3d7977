"""What a schedule's table costs in time, with a forward, a B and a W one unit each and a
whole backward two (the backward computes both gradients). Jax-free.

- `lockstep_time`: the SPMD program runs the table tick by tick on every stage at once, so
  a tick costs its slowest op (a tick where one stage runs a whole backward and another a
  forward costs 2).
- `mpmd_time`: the papers' ideal, each device running its own ops in the table's order as
  soon as their inputs exist (transfers free): the critical path.
- `work`: one stage's busy units (the same on every stage); `bubble` = 1 - work / time.
Forward-only tables (GPipe, circular) add their transposed backward: the same ticks again,
two units each. `recompute=True` (jaxpod's executors under remat `full`): a whole backward
and B first recompute their stage's forward, one unit more (3 and 2); W computes the weight
gradients alone from what B kept (`jaxpod.parallel.weight_split`), one unit, so the split
computes 1F1B's 4 units a micro-batch (XLA's cost analysis of a transformer stage: W 0.92
of a forward, B 2.08; docs/benchmarks.md, `benchmarks/branch_costs.py`).
"""

from __future__ import annotations

from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    Schedule,
    global_stage,
    needs,
)

COST = {IDLE: 0, FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1}


def costs(recompute: bool = False) -> dict:
    """Each op's units; with `recompute`, the forward a whole backward and B recompute
    added (W recomputes nothing)."""
    if not recompute:
        return dict(COST)
    return {**COST, BACKWARD: 3, BACKWARD_INPUT: 2}


def work(schedule: Schedule, recompute: bool = False) -> int:
    """Units one stage computes in a step (forwards, backwards; the transposed backward of a
    forward-only table included)."""
    cost = costs(recompute)
    units = sum(cost[int(o)] for o in schedule.op[:, 0])
    return units if schedule.explicit_backward else units * (1 + cost[BACKWARD])


def lockstep_time(schedule: Schedule, recompute: bool = False) -> int:
    """Units the lockstep SPMD program takes: each tick its slowest op."""
    cost = costs(recompute)
    ticks = sum(max(cost[int(o)] for o in row) for row in schedule.op)
    return ticks if schedule.explicit_backward else ticks * (1 + cost[BACKWARD])


def mpmd_time(schedule: Schedule, cost: dict | None = None) -> float:
    """Units each device running its ops in order, each as soon as its input exists; `cost`
    each op's units (default `COST`)."""
    cost = COST if cost is None else cost
    if not schedule.explicit_backward:
        return lockstep_time(schedule)
    s_, kind = schedule.stages, schedule.kind
    queues = [schedule.ops(s) for s in range(s_)]
    finish: dict = {}
    free, nxt = [0] * s_, [0] * s_
    while any(n < len(q) for n, q in zip(nxt, queues, strict=True)):
        for s in range(s_):
            while nxt[s] < len(queues[s]):
                _, o, m, r = queues[s][nxt[s]]
                need = needs(kind, o, m, r, s, s_, schedule.virtual)
                if need is not None and need not in finish:
                    break  # wait for another device
                start = max(free[s], finish.get(need, 0))
                free[s] = start + cost[o]
                finish[(o, m, global_stage(kind, s, r, s_))] = free[s]
                nxt[s] += 1
    return max(free)


def bubble(schedule: Schedule, time: int, recompute: bool = False) -> float:
    """The idle fraction of a step that takes `time` units."""
    return 1.0 - work(schedule, recompute) / time

"""Schedules past 1F1B: interleaved 1F1B, and the zero-bubble schedules that split the backward.

Each is built like `one_f_one_b`: a per-device order of ops, each placed on the first tick
its inputs exist (`place`), or for ZB-V chosen greedily tick by tick (`greedy`): a device
runs a ready B (the input gradient, on the critical path) first, else a forward if its
activation memory allows, else a deferred W (the weight gradient) that fills what would be
bubble. With F, B and W one tick each, both zero-bubble kinds take 3·V·M + S - 1 ticks.
Jax-free.

- `interleaved-1f1b` (Megatron's order): V virtual stages per device, global stage r·S + s;
  forwards in groups of S micro-batches per virtual stage, backwards in the reverse
  virtual-stage order; (S - s - 1)·2 + (V - 1)·S warm-up forwards. M a multiple of S.
- `zb-h1` (Qi et al.): 1F1B's order with the backward split into B and W, stage s's W
  deferred by s micro-batches: S micro-batches in flight on every stage (forward done, W
  not yet), 1F1B's most (its stage 0's).
- `zb-v`: two chunks per device in a V (device s holds global stages s and 2S - 1 - s, so
  device 0 holds the first and the last), B and W split, at most 2S chunk activations in
  flight (S whole stages: 1F1B's most).
"""

from __future__ import annotations

import functools

import numpy as np

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

Op = tuple[int, int, int]  # (op, micro-batch, virtual stage)


def _table_of(kind: str, stages: int, micro: int, virtual: int, rows: list) -> Schedule:
    shape = (len(rows), stages)
    op, mb, vs = np.zeros(shape, np.int32), np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
    for t, row in enumerate(rows):
        for s, (o, m, r) in enumerate(row):
            op[t, s], mb[t, s], vs[t, s] = o, m, r
    return Schedule(kind, stages, micro, virtual, op, mb, vs)


def place(kind: str, stages: int, micro: int, virtual: int, orders: list[list[Op]]) -> Schedule:
    """Each device's ops in `orders[s]`, each on the first tick after its input was made."""
    done: dict[tuple[int, int, int], int] = {}
    nxt, rows, t = [0] * stages, [], 0
    while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
        row = []
        for s in range(stages):
            if nxt[s] == len(orders[s]):
                row.append((IDLE, -1, 0))
                continue
            o, m, r = orders[s][nxt[s]]
            need = needs(kind, o, m, r, s, stages, virtual)
            ready = need is None or done.get(need, t) < t
            row.append((o, m, r) if ready else (IDLE, -1, 0))
            nxt[s] += ready
        for s, (o, m, r) in enumerate(row):
            if o != IDLE:
                done[(o, m, global_stage(kind, s, r, stages))] = t
        rows.append(row)
        t += 1
    return _table_of(kind, stages, micro, virtual, rows)


def interleaved_1f1b(stages: int, micro: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: the k-th forward of a device runs virtual stage
    (k // S) % V on micro-batch (k // (S·V))·S + k % S, its k-th backward virtual stage
    V - 1 - (k // S) % V; warm-up forwards, then one forward and one backward, then drain."""
    if micro % stages:
        raise ValueError(f"interleaved-1f1b: {micro} micro-batches are not a multiple of {stages}")
    total = micro * virtual
    micro_of = lambda k: (k // (stages * virtual)) * stages + k % stages  # noqa: E731
    fwd = [(FORWARD, micro_of(k), (k // stages) % virtual) for k in range(total)]
    bwd = [(BACKWARD, micro_of(k), virtual - 1 - (k // stages) % virtual) for k in range(total)]
    orders = []
    for s in range(stages):
        warm = min((stages - s - 1) * 2 + (virtual - 1) * stages, total)
        order = fwd[:warm]
        for i in range(total - warm):
            order += [fwd[warm + i], bwd[i]]
        orders.append(order + bwd[total - warm :])
    return place("interleaved-1f1b", stages, micro, virtual, orders)


def greedy(kind: str, stages: int, micro: int, virtual: int, cap: int) -> Schedule:
    """Tick by tick, each device runs its first ready op of: a B (lowest micro-batch, then
    the later global stage); a forward while fewer than `cap` chunks are in flight (forward
    done, W not: W needs the chunk's input and its output's cotangent); a W (oldest).

    A device runs each (op, virtual stage) in micro-batch order (what an op needs is ready
    for a lower micro-batch first), so only the lowest not yet run of each is a candidate:
    a tick looks at 3·V ops per device, not at all 3·V·M."""
    kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    lanes = [(o, r) for o in kinds for r in range(virtual)]
    nxt = [dict.fromkeys(lanes, 0) for _ in range(stages)]  # the next micro-batch of a lane
    done: dict[tuple[int, int, int], int] = {}
    held, rows, t, left = [0] * stages, [], 0, stages * len(lanes) * micro
    while left:
        row = []
        for s in range(stages):
            heads = [(o, m, r) for (o, r), m in nxt[s].items() if m < micro]
            wanted = [(op, needs(kind, *op, s, stages, virtual)) for op in heads]
            ready = [op for op, need in wanted if need is None or done.get(need, t) < t]
            pick = _pick(kind, s, stages, ready, held[s] < cap)
            row.append(pick or (IDLE, -1, 0))
            if pick:
                nxt[s][pick[0], pick[2]] += 1
                held[s] += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(pick[0], 0)
                left -= 1
        for s, (o, m, r) in enumerate(row):
            if o != IDLE:
                done[(o, m, global_stage(kind, s, r, stages))] = t
        rows.append(row)
        t += 1
    return _table_of(kind, stages, micro, virtual, rows)


def _pick(kind: str, s: int, stages: int, ready: list[Op], may_forward: bool) -> Op | None:
    """The op `greedy` runs of the `ready` ones on device s."""
    later = lambda op: (op[1], -global_stage(kind, s, op[2], stages))  # noqa: E731
    for o in (BACKWARD_INPUT, FORWARD, BACKWARD_WEIGHT):
        if o == FORWARD and not may_forward:
            continue
        of_kind = [op for op in ready if op[0] == o]
        if of_kind:
            return min(of_kind, key=later if o != BACKWARD_WEIGHT else lambda op: op[1:])
    return None


def zb_h1(stages: int, micro: int) -> Schedule:
    """ZB-H1: 1F1B's order with each backward split into B and W, and stage s's W of a
    micro-batch deferred until s later B have run (the later stages, which wait least for
    their inputs, defer most), the deferred W run once the B are done."""
    orders = []
    for s in range(stages):
        warm = min(stages - s, micro)
        order = [(FORWARD, m, 0) for m in range(warm)]
        weights = []
        for m in range(micro):
            order.append((BACKWARD_INPUT, m, 0))
            weights.append((BACKWARD_WEIGHT, m, 0))
            if m >= s:
                order.append(weights.pop(0))
            if warm + m < micro:
                order.append((FORWARD, warm + m, 0))
        orders.append(order + weights)
    return place("zb-h1", stages, micro, 1, orders)


def zb_v(stages: int, micro: int) -> Schedule:
    """ZB-V: two chunks per device in a V, at most 2S chunk activations in flight."""
    return greedy("zb-v", stages, micro, 2, 2 * stages)


def weight_slots(schedule: Schedule) -> tuple[np.ndarray, int]:
    """`([ticks, stages] slot, count)`: where a stage keeps what B of (micro-batch, chunk)
    saves for its W, on the B's and the W's ticks (-1 elsewhere), a slot taken at B and
    freed at W (the lowest free one), and the most slots a stage uses (at least 1)."""
    slot = np.full(schedule.op.shape, -1, np.int32)
    count = 1
    for s in range(schedule.stages):
        free: list[int] = []
        taken: dict[tuple[int, int], int] = {}
        for t, op, m, r in schedule.ops(s):
            if op == BACKWARD_INPUT:
                taken[m, r] = free.pop(0) if free else len(taken) + len(free)
                slot[t, s] = taken[m, r]
                count = max(count, int(slot[t, s]) + 1)
            elif op == BACKWARD_WEIGHT:
                slot[t, s] = taken.pop((m, r))
                free = sorted([*free, int(slot[t, s])])
    return slot, count


@functools.lru_cache(maxsize=512)
def slot_count(kind: str, stages: int, micro: int, virtual: int) -> int:
    """`weight_slots`' count for a table by its name (worked out once per table: a search
    plans the same tables many times)."""
    from jaxpod.parallel.schedules import make_schedule

    return weight_slots(make_schedule(kind, stages, micro, virtual))[1]

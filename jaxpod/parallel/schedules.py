"""Pipeline schedules as data: which micro-batch each stage runs forward or backward, per tick.

A schedule is a small table, a pure function of (kind, S stages, M micro-batches, V virtual
stages per device), that the executors in `jaxpod.parallel.pipeline` run as one `lax.scan`
over its ticks, and that the planner and the notebook's charts read. On tick t, stage s runs:

    op[t, s]         IDLE, FORWARD, BACKWARD, or the split backward's B and W
    micro[t, s]      the micro-batch it runs (-1 when idle)
    virtual_stage[t, s]  which of its V virtual stages r (`global_stage`) it runs

Kinds (bubble = idle fraction of the stage-ticks, `Schedule.bubble`):

- `gpipe`: all forwards, M + S - 1 ticks; the backward is the same scan transposed by
  autodiff. Bubble (S - 1) / (M + S - 1); every micro-batch's activations live until its
  backward, so memory grows with M.
- `circular`: V virtual stages per device, layers assigned round-robin (virtual stage r of
  stage s is the global stage r·S + s); micro-batches go V times around the ring in groups
  of S, V·M + S - 1 ticks; bubble (S - 1) / (V·M + S - 1). M must be a multiple of S.
- `1f1b`: forwards and backwards in one table, each tick one op per stage: stage s runs
  min(S - s, M) warm-up forwards, then alternates one backward and one forward, then drains;
  2(M + S - 1) ticks. A stage holds at most S - s micro-batches' inputs, whatever M.
- `zb-h1`, `interleaved-1f1b`, `zb-v`: `jaxpod.parallel.schedules_split`.
Jax-free (numpy only), so the planner can use it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

# CHUNKED and STEPWISE are the config's lists, named here for the executors and the planner
from jaxpod.config.schema import CHUNKED, STEPWISE, PipelineSchedule  # noqa: F401

IDLE, FORWARD, BACKWARD = 0, 1, 2
# the backward split (zero-bubble kinds): B, the input gradient; W, the weight gradient
BACKWARD_INPUT, BACKWARD_WEIGHT = 3, 4
# the kinds `train.pipeline_schedule` names, each a table `make_schedule` builds and an
# executor runs; STEPWISE (stage by stage: `train_ticks`, or over chunks
# `train_chunk_ticks`) and CHUNKED are the config's own lists
KINDS: tuple[str, ...] = typing.get_args(PipelineSchedule)
TABLES = KINDS
# the kinds whose V virtual stages per device sit in a V: device s holds s and 2S - 1 - s
V_SHAPED = ("zb-v",)


def global_stage(kind: str, stage: int, virtual_stage: int, stages: int) -> int:
    """The global stage (its place in the layer stack) of virtual stage r of `stage`:
    round-robin r·S + s, or in a V (`V_SHAPED`) s for r = 0 and 2S - 1 - s for r = 1."""
    if kind in V_SHAPED:
        return stage if virtual_stage == 0 else 2 * stages - 1 - stage
    return virtual_stage * stages + stage


def needs(kind: str, op: int, m: int, r: int, s: int, stages: int, virtual: int):
    """The `(op, micro-batch, global stage)` that must be done before `op` of micro-batch
    `m` runs on virtual stage `r` of stage `s` (None: nothing): a forward needs the previous
    global stage's, a backward (or B) the next one's (the last stage's, its own forward), a
    W its B."""
    g = global_stage(kind, s, r, stages)
    last = stages * virtual - 1
    if op == FORWARD:
        return (FORWARD, m, g - 1) if g > 0 else None
    if op == BACKWARD_WEIGHT:
        return (BACKWARD_INPUT, m, g)
    done = BACKWARD if op == BACKWARD else BACKWARD_INPUT
    return (done, m, g + 1) if g < last else (FORWARD, m, g)


@dataclass(frozen=True)
class Schedule:
    """The table of one schedule; arrays are `[ticks, stages]` int32 (see the module doc)."""

    kind: str
    stages: int
    micro: int
    virtual: int
    op: np.ndarray
    micro_index: np.ndarray
    virtual_stage: np.ndarray

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    @property
    def explicit_backward(self) -> bool:
        """The table holds the backward ops (else autodiff transposes the forward scan)."""
        return bool(np.isin(self.op, (BACKWARD, BACKWARD_INPUT)).any())

    @property
    def bubble(self) -> float:
        """Idle fraction of the stage-ticks of the whole step (forward and backward). For
        forward-only tables the backward is the transposed scan: the same fraction."""
        busy = self.op != IDLE
        return float(1.0 - busy.sum() / busy.size)

    @cached_property
    def in_flight(self) -> np.ndarray:
        """`[stages]`: the most micro-batches (chunks, with virtual stages) a stage holds
        between a forward and the backward that frees it (the whole backward, or W: what B
        and W need is kept until W). Forward-only tables: all M."""
        if not self.explicit_backward:
            return np.full(self.stages, self.micro, np.int32)
        out = np.zeros(self.stages, np.int32)
        for s in range(self.stages):
            held = 0
            for t in range(self.ticks):
                op = self.op[t, s]
                held += int(op == FORWARD) - int(op in (BACKWARD, BACKWARD_WEIGHT))
                out[s] = max(out[s], held)
        return out

    def ops(self, stage: int) -> list[tuple[int, int, int, int]]:
        """`(tick, op, micro-batch, virtual stage)` of every non-idle entry of `stage`, in order."""
        rows = (self.op, self.micro_index, self.virtual_stage)
        col = zip(*(a[:, stage] for a in rows), strict=True)
        return [(t, int(o), int(m), int(c)) for t, (o, m, c) in enumerate(col) if o != IDLE]


def _table(ticks: int, stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shape = (ticks, stages)
    return np.zeros(shape, np.int32), np.full(shape, -1, np.int32), np.zeros(shape, np.int32)


def gpipe(stages: int, micro: int) -> Schedule:
    """Fill and drain: on tick t stage s forwards micro-batch t - s."""
    op, mb, virtual_stage = _table(micro + stages - 1, stages)
    for t in range(op.shape[0]):
        for s in range(stages):
            if 0 <= t - s < micro:
                op[t, s], mb[t, s] = FORWARD, t - s
    return Schedule("gpipe", stages, micro, 1, op, mb, virtual_stage)


def circular(stages: int, micro: int, virtual: int) -> Schedule:
    """V laps around the ring in groups of S micro-batches: stage s on tick t, with
    u = t - s, runs micro-batch (u // (S·V))·S + u % S on its virtual stage (u % (S·V)) // S."""
    if micro % stages:
        raise ValueError(f"circular: {micro} micro-batches are not a multiple of {stages} stages")
    op, mb, virtual_stage = _table(virtual * micro + stages - 1, stages)
    lap = stages * virtual
    for t in range(op.shape[0]):
        for s in range(stages):
            u = t - s
            if u < 0 or u >= virtual * micro:
                continue
            op[t, s] = FORWARD
            mb[t, s] = (u // lap) * stages + u % stages
            virtual_stage[t, s] = (u % lap) // stages
    return Schedule("circular", stages, micro, virtual, op, mb, virtual_stage)


def one_f_one_b(stages: int, micro: int) -> Schedule:
    """1F1B (PipeDream-flush): each stage's ops in the order warm-up forwards, (backward,
    forward) pairs, drain; each op placed on the first tick its inputs exist: a forward after
    the previous stage's, a backward after the next stage's (the last stage's right after
    its own forward)."""
    orders = []
    for s in range(stages):
        warm = min(stages - s, micro)
        order = [(FORWARD, m) for m in range(warm)]
        for m in range(micro - warm):
            order += [(BACKWARD, m), (FORWARD, warm + m)]
        order += [(BACKWARD, m) for m in range(micro - warm, micro)]
        orders.append(order)
    done: dict[tuple[int, int, int], int] = {}  # (op, micro, stage) -> tick
    rows: list[list[tuple[int, int]]] = []
    nxt = [0] * stages
    t = 0
    while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
        row = []
        for s in range(stages):
            if nxt[s] == len(orders[s]):
                row.append((IDLE, -1))
                continue
            o, m = orders[s][nxt[s]]
            if o == FORWARD:
                need = (FORWARD, m, s - 1) if s > 0 else None
            else:
                need = (BACKWARD, m, s + 1) if s < stages - 1 else (FORWARD, m, s)
            if need is None or done.get(need, t) < t:
                row.append((o, m))
                nxt[s] += 1
            else:
                row.append((IDLE, -1))
        for s, (o, m) in enumerate(row):
            if o != IDLE:
                done[(o, m, s)] = t
        rows.append(row)
        t += 1
    op, mb, virtual_stage = _table(len(rows), stages)
    for t, row in enumerate(rows):
        for s, (o, m) in enumerate(row):
            op[t, s], mb[t, s] = o, m
    return Schedule("1f1b", stages, micro, 1, op, mb, virtual_stage)


@lru_cache(maxsize=512)
def make_schedule(kind: str, stages: int, micro: int, virtual: int = 1) -> Schedule:
    """The table of `kind` (one of `TABLES`) for `stages` stages and `micro` micro-batches.
    Built once per arguments (the planner and `search` ask for the same tables many times);
    its arrays are read-only."""
    table = _build(kind, stages, micro, virtual)
    for array in (table.op, table.micro_index, table.virtual_stage):
        array.flags.writeable = False
    return table


def _build(kind: str, stages: int, micro: int, virtual: int) -> Schedule:
    from jaxpod.parallel import schedules_split as split

    if kind == "interleaved-1f1b":
        return split.interleaved_1f1b(stages, micro, virtual)
    if kind == "zb-h1":
        return split.zb_h1(stages, micro)
    if kind == "zb-v":
        return split.zb_v(stages, micro)
    if kind == "gpipe":
        return gpipe(stages, micro)
    if kind == "circular":
        return circular(stages, micro, virtual)
    if kind == "1f1b":
        return one_f_one_b(stages, micro)
    raise ValueError(f"unknown pipeline schedule {kind!r}; choose from {', '.join(TABLES)}")


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` with its backward ops made idle: its forwards, where and when it runs
    them (an evaluation of a stage-by-stage schedule in its own layer placement)."""
    keep = schedule.op == FORWARD
    op = np.where(keep, schedule.op, IDLE).astype(np.int32)
    micro = np.where(keep, schedule.micro_index, -1).astype(np.int32)
    virtual = np.where(keep, schedule.virtual_stage, 0).astype(np.int32)
    return Schedule(
        schedule.kind, schedule.stages, schedule.micro, schedule.virtual, op, micro, virtual
    )


def layer_order(layers: int, stages: int, virtual: int, kind: str = "circular") -> np.ndarray:
    """Where each stored layer comes from: stage s's contiguous part of the stored stack
    holds its virtual stages r = 0..V-1, i.e. the global stages `global_stage(kind, s, r)`
    (round-robin r·S + s, or in a V), in that order. `stored[i] = logical[order[i]]`;
    V = 1: identity."""
    per_virtual = layers // (stages * virtual)  # the layers of one virtual stage
    order = [
        global_stage(kind, s, r, stages) * per_virtual + j
        for s in range(stages)
        for r in range(virtual)
        for j in range(per_virtual)
    ]
    return np.asarray(order, np.int32)

"""Where each value of a virtual-stage schedule goes, worked out from its table. numpy only.

With V chunks (virtual stages) per device, a forward's output goes to the device holding the
next global stage: the next device (round-robin, from the last device back to the first), the
previous one (a V's second arm), or the same device (the bottom of a V). A backward's input
gradient goes the other way. The executor (`jaxpod.parallel.pipeline_chunks`) sends at most
one value per tick each way round the ring (`ppermute` to s + 1 and to s - 1), and keeps what
a device holds in two buffers of `slots` entries: the chunks' kept inputs, and the gradients
waiting for their backward. `Routes` holds, per tick and stage, which slot each op reads and
where each received or handed-over value is stored, allocated here so that no two values a
device holds at once share a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    Schedule,
    global_stage,
)

NOTHING, ACT, GRAD = 0, 1, 2  # what a send carries (`Routes.send_down` / `send_up`)
FREES = (BACKWARD, BACKWARD_WEIGHT)  # the ops after which a chunk's input and gradient go


@dataclass(frozen=True)
class Routes:
    """`[ticks, stages]` int32 tables (-1: none). `gstage`: the op's global stage; `act` and
    `grad`: the slots of the op's kept input and gradient; `send_down`/`send_up`: what the
    op sends to s + 1 / s - 1 (`NOTHING`, `ACT`, `GRAD`); `down_slot`/`up_slot`: where the
    value arriving from s - 1 / s + 1 at the start of the tick is stored (its kind is the
    sender's); `local`: the slot of the handed-over value (a forward's output kept as the
    next chunk's input, or a backward's gradient kept for the previous chunk's), its kind
    `ACT` after a forward, `GRAD` after a backward; `slots`: the buffers' size."""

    gstage: np.ndarray
    act: np.ndarray
    grad: np.ndarray
    send_down: np.ndarray
    send_up: np.ndarray
    down_slot: np.ndarray
    up_slot: np.ndarray
    local: np.ndarray
    slots: int


def _device(kind: str, g: int, stages: int, virtual: int) -> tuple[int, int]:
    """`(device, chunk)` holding global stage g."""
    for s in range(stages):
        for r in range(virtual):
            if global_stage(kind, s, r, stages) == g:
                return s, r
    raise ValueError(f"no device holds global stage {g}")


def _direction(src: int, dst: int, stages: int) -> str:
    if dst == src:
        return "local"
    return "down" if dst == (src + 1) % stages else "up"


def routes(sched: Schedule) -> Routes:
    """The routes of `sched` (see the module docstring)."""
    kind, s_, v = sched.kind, sched.stages, sched.virtual
    last = s_ * v - 1
    shape = sched.op.shape
    gst, act, grad = (np.full(shape, -1, np.int32) for _ in range(3))
    send_down, send_up = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    down_slot, up_slot, local = (np.full(shape, -1, np.int32) for _ in range(3))
    pools = [_Pool() for _ in range(s_)]  # per device: (kind, micro, gstage) -> slot
    pending: list = []  # values sent on tick t, stored on tick t + 1: (dst, field, key)
    for t in range(shape[0]):
        for dst, field, key in pending:  # what arrived at the start of the tick
            slot = pools[dst].take(key)
            if field == "local":
                local[t - 1, dst] = slot
            else:
                (down_slot if field == "down" else up_slot)[t, dst] = slot
        pending = []
        for s in range(s_):
            o = int(sched.op[t, s])
            if o == IDLE:
                continue
            m, r = int(sched.micro_index[t, s]), int(sched.virtual_stage[t, s])
            g = global_stage(kind, s, r, s_)
            gst[t, s] = g
            pool = pools[s]
            if o == FORWARD and g == 0:
                pool.take((ACT, m, g))  # the embedded input, kept for the backward
            act[t, s] = pool.slot((ACT, m, g))
            if o == FORWARD and g == last:
                pool.take((GRAD, m, g))  # the head's gradient, kept for the backward
            if o != FORWARD:
                grad[t, s] = pool.slot((GRAD, m, g))
            if o == FORWARD and g == last:
                grad[t, s] = pool.slot((GRAD, m, g))
            nxt = g + 1 if o == FORWARD else g - 1
            if o in (FORWARD, BACKWARD, BACKWARD_INPUT) and 0 <= nxt <= last:
                dst, _ = _device(kind, nxt, s_, v)
                way = _direction(s, dst, s_)
                what = ACT if o == FORWARD else GRAD
                if way != "local":
                    (send_down if way == "down" else send_up)[t, s] = what
                pending.append((dst, way, (what, m, nxt)))
            if o in FREES:
                pool.free((ACT, m, g))
                pool.free((GRAD, m, g))
    slots = max(p.high for p in pools)
    return Routes(gst, act, grad, send_down, send_up, down_slot, up_slot, local, slots)


class _Pool:
    """One device's slots: the lowest free one given to each value it starts holding."""

    def __init__(self):
        self.held: dict = {}
        self.high = 0

    def take(self, key) -> int:
        used = set(self.held.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[key] = slot
        self.high = max(self.high, slot + 1)
        return slot

    def slot(self, key) -> int:
        return self.held[key]

    def free(self, key) -> None:
        self.held.pop(key, None)

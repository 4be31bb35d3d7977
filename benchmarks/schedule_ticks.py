"""What the stepwise schedules cost in lockstep SPMD ticks against the MPMD ideal, from the
tables and the ops' costs (`bench_schedules.tick_costs`, within 2 % of XLA's cost analysis).

    python benchmarks/schedule_ticks.py [--meshes 1x4x1,2x2x2] [--micro 4,8,16]

Each in stage forwards over the one-device step's work (`useful_work`), the scale of
bench_schedules' executed / useful FLOPs:

    lockstep  every tick costs the slowest op any device runs in it (the ticks' ppermutes
              hold the devices together): what a chip per device pays
    busy      the ops a device runs, on average (a bubble costs nothing): what a host with
              fewer cores than devices pays, the idle devices' cores lent to the busy ones
    MPMD      each device runs its table's ops in order, each as soon as its input exists
              and the device is free, no ticks (`schedule_time.mpmd_time`): the papers' ideal
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_schedules import tick_costs, useful_work  # noqa: E402
from common import options, table  # noqa: E402

from jaxpod.parallel.schedule_time import mpmd_time  # noqa: E402
from jaxpod.parallel.schedules import Schedule, make_schedule  # noqa: E402

KINDS = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "zb-v": 2}  # kind: V


def op_costs(schedule: Schedule) -> dict[int, float]:
    """Each op code's cost in stage forwards (a chunk's 1/V of a stage's)."""
    cost = tick_costs(schedule.stages, schedule.virtual)
    return {0: 0.0, **{o: c / schedule.virtual for o, c in cost.items()}}


def row(kind: str, stages: int, micro: int) -> list:
    schedule = make_schedule(kind, stages, micro, KINDS[kind])
    cost = op_costs(schedule)
    costs = np.vectorize(cost.get)(schedule.op)
    scale = micro * useful_work()
    lockstep = costs.max(axis=1).sum() / scale
    busy = costs.sum() / (stages * scale)
    mpmd = mpmd_time(schedule, cost) / scale
    return [kind, micro, schedule.ticks, f"{lockstep:.3f}", f"{busy:.3f}", f"{mpmd:.3f}"]


def main() -> None:
    ap = options(__doc__)
    ap.add_argument("--meshes", default="1x4x1,2x2x2", help="replica x pipeline x tensor")
    ap.add_argument("--micro", default="4,8,16", help="micro-batches per replica")
    args = ap.parse_args()
    for mesh in args.meshes.split(","):
        stages = int(mesh.split("x")[1])
        rows = [row(k, stages, int(m)) for k in KINDS for m in args.micro.split(",")]
        header = ["schedule", "M", "ticks", "lockstep", "busy", "MPMD"]
        print(table(f"{mesh}: stage forwards over the useful work", header, rows))


if __name__ == "__main__":
    main()

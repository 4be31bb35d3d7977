"""Pipeline tick charts drawn from `jaxpod.parallel.schedules.make_schedule`, the table the
executor scans over, and the measured memory and step time of each schedule against M.

A chart has one row per stage and one cell per op: the micro-batch the stage runs, forward
(solid), whole backward (pale, twice a forward's time), or the split backward's B and W.
gpipe and circular tables hold forwards only; autodiff runs the same scan transposed, so
their backward half is the table's ticks in reverse order. A tick of a virtual stage runs
1/V of a stage's layers; the x axis is in units of one stage's forward, in lockstep.
"""

from __future__ import annotations

import numpy as np

from jaxpod.parallel.schedule_time import COST, bubble, lockstep_time
from jaxpod.parallel.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    Schedule,
    make_schedule,
)

CASES = (("gpipe", 1), ("circular", 2), ("1f1b", 1))  # the schedules the executors run, V
# every table, for the charts: the split schedules beside the ones they improve
TABLE_CASES = (*CASES, ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))
MICRO_COLOURS = [
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#86bcb6",
    "#d37295",
    "#a0cbe8",
]


def full_step(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(op, micro, virtual_stage)`, each `[ticks, stages]`, of the whole step: the table
    itself when it holds the backward ops (1f1b), else the table followed by its reverse as
    backward."""
    if schedule.explicit_backward:
        return schedule.op, schedule.micro_index, schedule.virtual_stage
    back = np.where(schedule.op[::-1] == FORWARD, BACKWARD, IDLE)
    op = np.concatenate([schedule.op, back])
    micro = np.concatenate([schedule.micro_index, schedule.micro_index[::-1]])
    virtual = np.concatenate([schedule.virtual_stage, schedule.virtual_stage[::-1]])
    return op, micro, virtual


def draw_schedule(ax, schedule: Schedule, xmax: float | None = None) -> None:
    """One schedule's tick chart on `ax`: stages top to bottom, lockstep time left to right
    (`jaxpod.parallel.schedule_time`: a tick lasts its slowest op; what a faster op leaves
    of it is drawn as waiting)."""
    from matplotlib.ticker import MultipleLocator

    op, micro, virtual = full_step(schedule)
    unit = 1.0 / schedule.virtual  # one chunk's forward, in stage forwards
    x = 0.0
    for t in range(op.shape[0]):
        slot = max(COST[int(o)] for o in op[t]) * unit
        for s in range(schedule.stages):
            o = int(op[t, s])
            width = COST[o] * unit
            if width < slot:  # idle, or done before the tick's slowest op
                ax.add_patch(_cell(x + width, s, slot - width, "0.92", "0.75", hatch="///"))
            if o != IDLE:
                _draw_op(ax, x, s, width, o, int(micro[t, s]), int(virtual[t, s]))
        x += slot
    held = ", ".join(str(int(k)) for k in schedule.in_flight)
    virtual = f", V={schedule.virtual}" if schedule.virtual > 1 else ""
    ax.set(
        xlim=(0, xmax or x),
        ylim=(schedule.stages, 0),
        yticks=np.arange(schedule.stages) + 0.5,
        yticklabels=[f"stage {s}" for s in range(schedule.stages)],
    )
    bubble_ = bubble(schedule, lockstep_time(schedule))
    ax.set_title(
        f"{schedule.kind}{virtual}: S={schedule.stages}, M={schedule.micro}, "
        f"{x:g} stage forwards in lockstep, bubble {bubble_:.0%}, "
        f"held per stage: {held}",
        fontsize=9,
        loc="left",
    )
    ax.xaxis.set_major_locator(MultipleLocator(2))
    ax.tick_params(axis="both", labelsize=8)


# op -> (opacity, hatch, label suffix): forward solid, whole backward pale, B and W marked
LOOKS = {FORWARD: (1.0, None, ""), BACKWARD: (0.45, None, "")}
LOOKS |= {BACKWARD_INPUT: (0.6, None, "B"), BACKWARD_WEIGHT: (0.3, "...", "W")}


def _draw_op(ax, x: float, s: int, width: float, o: int, m: int, r: int) -> None:
    """One op's cell: coloured by micro-batch, a dark band for a later virtual stage."""
    alpha, hatch, suffix = LOOKS[o]
    colour = MICRO_COLOURS[m % len(MICRO_COLOURS)]
    ax.add_patch(_cell(x, s, width, colour, "k", alpha=alpha, hatch=hatch))
    if r:  # a later virtual stage: a dark band along the cell's top
        ax.add_patch(_cell(x, s, width, "0.2", "0.2", height=0.12 * r))
    label = f"{m}" + ("'" * r) + suffix
    ax.text(x + width / 2, s + 0.5, label, ha="center", va="center", fontsize=6)


def _cell(x, y, width, face, edge, alpha=1.0, hatch=None, height=1.0):
    from matplotlib.patches import Rectangle

    return Rectangle(
        (x, y), width, height, facecolor=face, edgecolor=edge, lw=0.5, alpha=alpha, hatch=hatch
    )


def schedules_figure(stages: int = 4, micro: int = 8, cases=CASES):
    """Every schedule of `cases` (kind, V) for S stages and M micro-batches, one under
    another, on a shared time axis (one stage's forward = 1)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tables = [make_schedule(kind, stages, micro, v) for kind, v in cases]
    xmax = max(lockstep_time(t) / t.virtual for t in tables)
    fig, axes = plt.subplots(len(tables), 1, figsize=(11, 1.4 + 0.6 * stages * len(tables)))
    for ax, table in zip(axes, tables, strict=True):
        draw_schedule(ax, table, xmax)
    axes[-1].set_xlabel("time, in one stage's forward (a whole backward takes two; a chunk 1/V)")
    legend = [
        Patch(facecolor=MICRO_COLOURS[0], edgecolor="k", label="forward of micro-batch 0"),
        Patch(facecolor=MICRO_COLOURS[0], alpha=0.45, edgecolor="k", label="backward"),
        Patch(facecolor=MICRO_COLOURS[0], alpha=0.6, edgecolor="k", label="B: input grads"),
        Patch(facecolor=MICRO_COLOURS[0], alpha=0.3, hatch="...", label="W: weight grads"),
        Patch(facecolor="0.2", edgecolor="0.2", label="top band: virtual stage 1 (label 0')"),
        Patch(facecolor="0.92", edgecolor="0.75", hatch="///", label="bubble or lockstep wait"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        "Pipeline schedules as tables (jaxpod.parallel.schedules.make_schedule)", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _series(section: dict, prefix: str, kind: str) -> tuple[list[int], list[dict]]:
    """The `M=` points of one schedule in a `bench_schedules.py` section, sorted by M."""
    points = {}
    for key, value in section.items():
        head, _, m = key.rpartition(" M=")
        if head == f"{prefix}{kind}".strip():
            points[int(m)] = value
    return sorted(points), [points[m] for m in sorted(points)]


def draw_measurements(axes, report: dict) -> None:
    """`docs/figures/data/schedules.json` (`benchmarks/bench_schedules.py`'s JSON):
    XLA's compiled device total against M on 1x4x1 (the planner's dashed) on `axes[0]`, the
    measured step time against M on each mesh on `axes[1]`."""
    colours = {kind: f"C{i}" for i, (kind, _) in enumerate(CASES)}
    for kind, _ in CASES:
        ms, points = _series(report.get("memory", {}), "", kind)
        if ms:
            axes[0].plot(
                ms,
                [p["compiled"] / 1e6 for p in points],
                "o-",
                color=colours[kind],
                label=f"{kind}: XLA",
            )
            axes[0].plot(
                ms,
                [p["planned"] / 1e6 for p in points],
                "x--",
                color=colours[kind],
                alpha=0.7,
                label=f"{kind}: planner",
            )
    meshes = sorted({key.split(" ")[0] for key in report.get("time", {})})
    for style, mesh in zip(("o-", "s:"), meshes, strict=False):
        for kind, _ in CASES:
            ms, points = _series(report["time"], f"{mesh} ", kind)
            if ms:
                axes[1].plot(
                    ms,
                    [p["step_s"] * 1e3 for p in points],
                    style,
                    color=colours[kind],
                    label=f"{kind}, {mesh}",
                )
    axes[0].set(
        xlabel="micro-batches M", ylabel="MB per device", title="compiled device total on 1x4x1"
    )
    axes[1].set(xlabel="micro-batches M", ylabel="ms per step", title="step time")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ms = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()})
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.minorticks_off()
        if ax.get_lines():
            ax.legend(fontsize=7)

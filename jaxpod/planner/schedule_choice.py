"""Which pipeline schedule to run a mapping with, and why. Jax-free.

Every schedule the mapping can run (chunked ones with 2 virtual stages; the divisibility
rules of `jaxpod.config.divisibility` say which) is priced by its own table in lockstep —
jaxpod's SPMD program, a tick as long as its slowest op (`jaxpod.parallel.schedule_time`,
with remat `full` each backward op's recomputation counted) — and planned for its bytes; the
advice is the fastest of those that fit, ties to fewer bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpod.config import Config
from jaxpod.config.divisibility import accepts, sizes
from jaxpod.config.schema import CHUNKED
from jaxpod.parallel.schedule_time import bubble, lockstep_time
from jaxpod.parallel.schedules import KINDS, make_schedule
from jaxpod.planner.report import format_bytes


def _with_schedule(cfg: Config, kind: str, virtual: int) -> Config:
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, pipeline_schedule=kind, virtual_stages=virtual)
    )


def candidates(cfg: Config) -> list[tuple[str, int]]:
    """`(kind, virtual stages)` of each schedule `cfg`'s mapping can run: its own, and every
    kind, chunked ones with 2 virtual stages, that the divisibility rules accept with `cfg`'s
    layers, micro-batches and phases (`jaxpod.config.divisibility`)."""
    own = (cfg.train.pipeline_schedule, cfg.train.virtual_stages)
    out = []
    for kind in KINDS:
        virtual = 2 if kind in CHUNKED else 1
        if (kind, virtual) == own or accepts(sizes(_with_schedule(cfg, kind, virtual))):
            out.append((kind, virtual))
    return out if own in out else [own, *out]


def _priced(cfg: Config, kind: str, virtual: int, recompute: bool) -> tuple[float, float]:
    """`(time, idle)`: the pass's lockstep time in stage forwards (a chunk's tick 1/V) and
    its idle fraction, from the schedule's table."""
    table = make_schedule(kind, cfg.mesh.pipeline, cfg.pipeline_group, virtual)
    time = lockstep_time(table, recompute)
    return time / virtual, bubble(table, time, recompute)


def advise(cfg: Config, limit: int, device_total: Callable[[Config], int]) -> dict | None:
    """The schedule to run `cfg`'s pipeline with: `{"kind", "virtual_stages", "time",
    "bubble", "device_total", "reason"}` (a pass's lockstep time in stage forwards, its idle
    fraction, bytes per device), or None without a pipeline."""
    if cfg.mesh.pipeline == 1:
        return None
    recompute = cfg.model.remat == "full"  # each backward op recomputes its stage first
    rows = []
    for kind, virtual in candidates(cfg):
        trial = _with_schedule(cfg, kind, virtual)
        rows.append((kind, virtual, *_priced(cfg, kind, virtual, recompute), device_total(trial)))
    fitting = [r for r in rows if r[4] <= limit] or rows
    kind, virtual, time, idle, total = min(fitting, key=lambda r: (round(r[2], 6), r[4]))
    t = cfg.train
    now, idle_now = _priced(cfg, t.pipeline_schedule, t.virtual_stages, recompute)
    if (kind, virtual) == (t.pipeline_schedule, t.virtual_stages):
        reason = f"the fastest in lockstep of those that fit ({idle:.0%} idle)"
    else:
        reason = (
            f"{time:g} stage forwards a pass in lockstep ({idle:.0%} idle) against "
            f"{t.pipeline_schedule}'s {now:g} ({idle_now:.0%}), {format_bytes(total)} per "
            f"device against {format_bytes(device_total(cfg))}"
        )
    return {
        "kind": kind,
        "virtual_stages": virtual,
        "time": time,
        "bubble": idle,
        "device_total": total,
        "reason": reason + ("" if total <= limit else "; none fits"),
    }

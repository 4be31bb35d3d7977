"""What a stepwise schedule's tick holds in the layers' backward (1F1B's family).

A tick's backward takes its chunk's vjp at once, from the chunk's kept input: the forward
recomputed, then the backward. With one layer a chunk, remat `none` compiles to remat
`full`'s program (`tick_policy`).

The zero-bubble schedules (B split from W: zb-h1, zb-v) keep for W, per chunk between its B
and its W (`slot_count` slots), each layer's use operands and output cotangents
(`layer_sets(...)["split"]`) and the stage input's gradient (`btd`): a slot, held once in
the tick scan's carry. A tick's op peaks at one of two moments (XLA:CPU's buffer assignment,
benchmarks/xla_peak.py on bench_schedules' GPT, 1x4x1, M = 8, remat `full` and `none`):

- inside B, a layer's backward: the chunk's residuals, the layer's working set, one copy
  of the stage's gradients (the carried one) and, where a chunk has more than one layer,
  the slot B builds (its layer scans' stacked outputs, less the uses' operands without
  remat: the residuals hold them; a one-layer chunk's slot values are its working set's);
- at the end of B's branch: the slot it returns, and the gradients the tick's `lax.switch`
  returns beside the carried ones (two copies); no residuals, no working set.

`device_bytes` counts two gradient copies at the backward for every stepwise schedule, so
the first moment enters with one copy less (`split_terms`). Analytic, no jax.
"""

from __future__ import annotations

from dataclasses import replace

from jaxpod.config import Config
from jaxpod.parallel.schedules import STEPWISE
from jaxpod.parallel.schedules_split import slot_count
from jaxpod.planner.counts import layer_params


def tick_policy(cfg: Config) -> Config:
    """`cfg` with the remat policy its layers' backward compiles to: a one-layer chunk of a
    stepwise schedule without remat holds what remat `full` holds (the tick recomputes the
    chunk's forward from its kept input either way; XLA:CPU's totals equal under both,
    bench_schedules' memory rows and tests/planner/test_stepwise_bytes.py)."""
    md, mesh, tr = cfg.model, cfg.mesh, cfg.train
    one = md.layers // (mesh.pipeline * tr.virtual_stages) == 1
    if mesh.pipeline > 1 and tr.pipeline_schedule in STEPWISE and one and md.remat == "none":
        return replace(cfg, model=replace(md, remat="full"))
    return cfg


def split_terms(cfg: Config, sets: dict, per_tick: int, grad_bytes: int) -> tuple[int, int]:
    """`(carry, op)`: the bytes of B's slots in the tick scan's carry, and those a tick's op
    adds at its peak besides the carry and two gradient copies (the larger of the module
    docstring's two moments; the backward tick's residuals among them). `sets`:
    `layer_sets`; `per_tick`: a chunk's layers; `grad_bytes`: a gradient scalar's."""
    md, mesh, tr = cfg.model, cfg.mesh, cfg.train
    slots = slot_count(tr.pipeline_schedule, mesh.pipeline, cfg.pipeline_group, tr.virtual_stages)
    slot = per_tick * sets["split"] + sets["btd"]
    sharded, replicated = layer_params(md)
    stage = md.layers // mesh.pipeline * (sharded // mesh.tensor + replicated)
    grads = stage * grad_bytes // cfg.memory.rts  # one copy of the stage's layer gradients
    building = 0  # a one-layer chunk's slot values are its working set's
    if per_tick > 1:  # without remat the residuals hold the uses' operands already
        building = slot - (per_tick * sets["split_operands"] if md.remat == "none" else 0)
    inside = per_tick * sets["saved"] + sets["work"] + building - grads
    return slots * slot, max(slot, inside)

"""What B keeps for W, and the chunked executor's route buffers, are held once in the
compiled step (XLA:CPU's buffer assignment).

B's buffers (`StageSplit.held`: per slot and layer, the uses' operands and output
cotangents) are the tick scan's carry; a tick's `lax.switch` reads them and returns one
slot's values, written in place after it (`put_slot`). A switch that returned the buffers
updated made XLA hold a second copy beside the carry. Here the values with a B buffer's
shape, `[slots, L, b, ...]` (`weight_slots`' slot count, the layers of a chunk), cover at
no moment of the program more than one copy of the buffers, and that copy is the planner's
count: `layer_sets(...)["split"]` bytes a layer (`_split_kept`), L layers a slot. Over
chunks, the route buffers of kept inputs and waiting gradients (`[K, b, T, D]`, K the slots
the routes assign) are carried and written after the switch too: two of them at most.
"""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step

from jaxpod.parallel.chunk_routes import routes
from jaxpod.parallel.schedules import make_schedule
from jaxpod.parallel.schedules_split import weight_slots
from jaxpod.planner.activations import compute_bytes, stored_bytes
from jaxpod.planner.layer import layer_sets
from jaxpod.planner.profiles import get_profile
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.engine

GPT = ("model.layers=8", "model.remat=full", "train.grad_accum=4", "optim.warmup_steps=0")
ZB_H1 = ("train.pipeline_schedule=zb-h1",)
CASES = {  # name: (overrides, mesh)
    "zb-h1-1x2x2": (ZB_H1, (1, 2, 2)),
    "zb-h1-sp-1x2x2": ((*ZB_H1, "model.sequence_parallel=true"), (1, 2, 2)),
    "zb-v-1x2x1": (("train.pipeline_schedule=zb-v", "train.virtual_stages=2"), (1, 2, 1)),
}


def _held_once(cfg) -> tuple[tuple[int, int, int], int]:
    """The leading dims `(slots, L, b)` of B's buffers and the bytes of one copy of them (the
    planner's), the stage input's gradient `[slots, b, T, D]` left out (a ring buffer of the
    stage inputs has its shape)."""
    tr, stages = cfg.train, cfg.mesh.pipeline
    table = make_schedule(tr.pipeline_schedule, stages, tr.grad_accum, tr.virtual_stages)
    slots = weight_slots(table)[1]
    layers = cfg.model.layers // (stages * tr.virtual_stages)
    profile = get_profile("cpu")
    split = layer_sets(cfg, compute_bytes(cfg, profile), stored_bytes(cfg, profile))["split"]
    return (slots, layers, tr.micro_batch), slots * layers * split


@pytest.mark.parametrize("name", sorted(CASES))
def test_b_buffers_are_held_once(name, mesh_for):
    overrides, mesh = CASES[name]
    cfg = make_tiny_cfg(*GPT, *overrides, mesh=mesh)
    lead, once = _held_once(cfg)
    _, _, (values, ranges, _) = dumped_step(cfg, mesh_for(cfg))
    held = {v: r for v, r in ranges.items() if dims_of(values[v][2])[:3] == lead}
    assert held, lead  # B's buffers are in the program
    most = max(covered(values, held, t) for t in range(max(b for _, b in held.values()) + 1))
    assert most == once, (most, once)


@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v"])
def test_route_buffers_are_held_once(kind, mesh_for):
    overrides = (f"train.pipeline_schedule={kind}", "train.virtual_stages=2")
    cfg = make_tiny_cfg(*GPT, *overrides, mesh=(1, 2, 1))
    md, tr = cfg.model, cfg.train
    table = make_schedule(kind, 2, tr.grad_accum, tr.virtual_stages)
    shape = (routes(table).slots, tr.micro_batch, md.seq_len, md.d_model)
    _, _, (values, ranges, _) = dumped_step(cfg, mesh_for(cfg))
    held = {v: r for v, r in ranges.items() if dims_of(values[v][2]) == shape}
    assert held, shape  # the route buffers are in the program
    most = max(covered(values, held, t) for t in range(max(b for _, b in held.values()) + 1))
    assert most == 2 * shape[0] * shape[1] * shape[2] * shape[3] * 4, (most, shape)  # float32

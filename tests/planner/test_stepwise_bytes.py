"""The stepwise schedules' bytes against the compiled program (`jaxpod.planner.stepwise_bytes`).

A GPT of 8 layers (d 128, seq 64, micro-batch 2), M = 8: on 1x4x1 zb-v's and interleaved
1F1B's chunks are one layer, zb-h1's stages two; on 2x2x2 two and four. A one-layer chunk
compiles to the same program without remat as under remat `full` (the tick recomputes its
forward either way), and the planner, which counts B's returned slot apart from the
residuals and a layer's working set (two moments, not one) and, without remat, the uses'
operands once, is within 10 % of XLA:CPU's device total on each cell.
"""

from __future__ import annotations

import pytest
from helpers import compiled_step_once

from jaxpod.planner.plan import plan

pytestmark = pytest.mark.engine

GPT = ("model.layers=8", "model.d_model=128", "model.d_ff=512", "model.seq_len=64")
GPT += ("model.heads=4", "train.micro_batch=2", "train.grad_accum=8", "optim.warmup_steps=0")
KINDS = {
    "zb-v": ("train.pipeline_schedule=zb-v", "train.virtual_stages=2"),
    "zb-h1": ("train.pipeline_schedule=zb-h1",),
    "interleaved-1f1b": ("train.pipeline_schedule=interleaved-1f1b", "train.virtual_stages=2"),
}


def _cfg(tiny_cfg, kind: str, remat: str, mesh=(1, 4, 1)):
    return tiny_cfg(*GPT, *KINDS[kind], f"model.remat={remat}", mesh=mesh)


def _total(cfg, mesh_for) -> int:
    """XLA's per-device arguments + temporaries of the compiled step."""
    mem = compiled_step_once(cfg, mesh_for).memory_analysis()
    return mem.argument_size_in_bytes + mem.temp_size_in_bytes


def test_a_one_layer_chunk_compiles_alike_without_remat(tiny_cfg, mesh_for):
    full, none = (_cfg(tiny_cfg, "zb-v", remat) for remat in ("full", "none"))
    assert _total(full, mesh_for) == _total(none, mesh_for)


@pytest.mark.parametrize(
    "kind, remat, mesh",
    [("zb-v", "full", (1, 4, 1)), ("zb-v", "none", (1, 4, 1)), ("zb-h1", "full", (1, 4, 1))]
    + [("zb-h1", "none", (1, 4, 1)), ("interleaved-1f1b", "none", (1, 4, 1))]
    + [("zb-v", "none", (2, 2, 2)), ("zb-h1", "none", (2, 2, 2))],
)
def test_planner_within_10_percent_of_the_compiled_step(kind, remat, mesh, tiny_cfg, mesh_for):
    cfg = _cfg(tiny_cfg, kind, remat, mesh)
    planned = plan(cfg)["bytes_per_device"]["device_total"]
    measured = _total(cfg, mesh_for)
    print(f"{kind} {mesh} {remat}: planned {planned / 1e6:.2f}, compiled {measured / 1e6:.2f} MB")
    assert planned == pytest.approx(measured, rel=0.10)

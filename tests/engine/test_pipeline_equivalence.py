"""Pipelining and sequence splitting change the order of the sums, never the numbers: GPipe
over micro-batches == gradient accumulation == the plain full batch; pipeline bubbles (the
carry pre-filled with NaN) never reach the loss or the gradients; `model.sequence_chunks` and
`model.sequence_parallel` on sharded meshes give the plain reference's loss and gradients.

Every pipelined run here starts its carry as NaN (`bubble_fill`) and checks that its
gradients come back with the params' shardings: the bubble claim on 1x2x1 (one pass and two)
and 2x2x2 (sequence chunks, sequence parallelism); on 4 stages it is test_mesh_equivalence.py's
1x4x2 train steps' (the lab's `NAN_FILLED` engines).

The reference comes from the session's equivalence lab (tests/helpers/lab.py): its plain
model's loss and gradients on the first batch, at its initial params. The engine runs at the
same params, put in its shardings (`helpers.lab.sharded_loss_and_grads`: no init program per
config; the engine's own init is test_mesh_equivalence.py's).
"""

from __future__ import annotations

import pytest
from helpers.lab import (
    GLOBAL_BATCH,
    GRAD_TOL,
    LAB_PROCESS,
    assert_loss_close,
    assert_sharded_as,
    assert_trees_close,
    mesh_id,
    sharded_loss_and_grads,
)

pytestmark = LAB_PROCESS

NAN = float("nan")


def reference(lab) -> dict:
    """{loss, grads} of the plain model on batch(0): the first of `lab.ref_steps` (its memo,
    shared with them; no optimizer step is needed here)."""
    loss, grads = lab.ref_loss_and_grads()
    return {"loss": loss, "grads": grads}


# --------------------------------------------------------------------------------------------
# 1. Pipeline micro-batching == gradient accumulation.
# --------------------------------------------------------------------------------------------


def test_pipeline_microbatches_equal_accumulation(lab):
    """GPipe over 4 micro-batches on 2 stages == two GPipe passes of 2 micro-batches
    (`train.pipeline_group=2`, gradients summed) == the 4-step accumulation loop on 1 device
    == the plain full-batch gradient. The pipelined runs start their carry as NaN: bubbles
    never reach the loss or the grads, which come back with the params' shardings."""
    runs = {
        "pipeline": ((1, 2, 1), []),
        "pipeline, 2 passes": ((1, 2, 1), ["train.pipeline_group=2"]),
        "accumulation": ((1, 1, 1), []),
    }
    out = {}
    for name, (shape, extra) in runs.items():
        cfg = lab.cfg(shape, "adamw", "train.micro_batch=4", *extra)
        assert (cfg.train.grad_accum, cfg.global_batch) == (4, GLOBAL_BATCH)
        fill = NAN if shape[1] > 1 else 0.0
        loss, grads, specs, mesh = sharded_loss_and_grads(lab, cfg, bubble_fill=fill)
        assert_sharded_as(grads, specs, mesh, f"grads {name}")
        out[name] = loss, grads
    ref = reference(lab)
    (pipe_loss, pipe_grads), (acc_loss, acc_grads) = out["pipeline"], out["accumulation"]
    assert_loss_close(pipe_loss, acc_loss, "pipeline vs accumulation")
    assert_trees_close(pipe_grads, acc_grads, GRAD_TOL, "grads pipeline vs accumulation")
    for name, (loss, grads) in out.items():
        assert_loss_close(loss, ref["loss"], f"{name} vs reference")
        assert_trees_close(grads, ref["grads"], GRAD_TOL, f"grads {name} vs reference")


# --------------------------------------------------------------------------------------------
# 2. Serialised sequence (`model.sequence_chunks`) on a sharded mesh.
# --------------------------------------------------------------------------------------------


def test_sequence_chunks_sharded_match_reference(lab):
    """A 2x2x2 step with model.sequence_chunks=4 gives the plain (unchunked, single-device)
    reference's loss and gradients (the carry NaN-filled, the grads sharded as the params)."""
    cfg = lab.cfg((2, 2, 2), "adamw", "model.sequence_chunks=4")
    loss, grads, specs, mesh = sharded_loss_and_grads(lab, cfg, bubble_fill=NAN)
    assert_sharded_as(grads, specs, mesh, "grads sequence chunks 2x2x2")
    ref = reference(lab)
    assert_loss_close(loss, ref["loss"], "sequence chunks 2x2x2 vs reference")
    assert_trees_close(grads, ref["grads"], GRAD_TOL, "sequence chunks 2x2x2 vs reference")


# --------------------------------------------------------------------------------------------
# 3. Sequence parallelism (`model.sequence_parallel`).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 2, 2)], ids=mesh_id)
def test_sequence_parallel_matches_reference(lab, shape):
    """With the residual stream split over `tensor` along the sequence (all-gather before
    the column-parallel matmuls, reduce-scatter after the row-parallel ones, positions and
    targets sliced to match), loss and every gradient equal the plain reference — the
    accumulation loop (pipeline 1) and the GPipe scan (pipeline 2, the carry NaN-filled;
    BERT's test adds 1x2x4); the grads come back sharded as the params."""
    cfg = lab.cfg(shape, "adamw", "model.sequence_parallel=true")
    fill = NAN if shape[1] > 1 else 0.0
    loss, grads, specs, mesh = sharded_loss_and_grads(lab, cfg, bubble_fill=fill)
    assert_sharded_as(grads, specs, mesh, f"grads sequence parallel {mesh_id(shape)}")
    ref = reference(lab)
    assert_loss_close(loss, ref["loss"], f"sequence parallel {mesh_id(shape)} vs reference")
    assert_trees_close(grads, ref["grads"], GRAD_TOL, f"sequence parallel {mesh_id(shape)}")

"""`plan`'s schedule advice (`jaxpod.planner.schedule_choice`): every schedule the mapping can
run priced by its own table in lockstep, the fastest that fits advised, with its reason."""

from __future__ import annotations

from helpers import make_tiny_cfg

from jaxpod.parallel.schedule_time import lockstep_time
from jaxpod.parallel.schedules import make_schedule
from jaxpod.planner.plan import plan
from jaxpod.planner.schedule_choice import candidates

PIPE = ("mesh.replica=1", "mesh.pipeline=4", "mesh.tensor=2", "train.grad_accum=8")


def test_without_recompute_zb_h1_is_the_fastest_table():
    """S = 4, M = 8, remat none, 4 layers (no chunks): gpipe's pass is 33 units (11 forward
    ticks, 22 backward), ZB-H1's 27 (F, B and W one unit each, every tick full but S - 1)."""
    cfg = make_tiny_cfg(*PIPE, "model.remat=none")
    advice = plan(cfg)["schedule_advice"]
    assert advice["kind"] == "zb-h1" and advice["time"] == 27
    assert advice["time"] == lockstep_time(make_schedule("zb-h1", 4, 8))
    assert "against gpipe's 33" in advice["reason"]


def test_with_full_recompute_each_backward_op_recomputes():
    """Remat full: B recomputes its stage (2 units), W computes weight gradients alone (1), a
    whole backward 3; a lockstep tick costs its dearest op, so B beside a forward costs 2
    and the split schedules (zb-h1 49, zb-v 46.5 stage units a pass) lose to circular
    (V = 2): 19 forward ticks of half a stage, then its transposed backward of 1.5 stages a
    tick: 19 * 4 / 2 = 38 (gpipe 44)."""
    cfg = make_tiny_cfg(*PIPE, "model.layers=8", "model.remat=full")
    advice = plan(cfg)["schedule_advice"]
    assert advice["kind"] == "circular" and advice["virtual_stages"] == 2
    assert advice["time"] == lockstep_time(make_schedule("circular", 4, 8, 2), True) / 2 == 38
    assert lockstep_time(make_schedule("zb-h1", 4, 8), True) == 49
    assert lockstep_time(make_schedule("zb-v", 4, 8, 2), True) / 2 == 46.5
    assert "against gpipe's 44" in advice["reason"]


def test_heterogeneous_stages_are_offered_no_chunks():
    cfg = make_tiny_cfg(
        "model.name=efficientnet",
        "data.name=digits",
        "mesh.tensor=1",
        "mesh.replica=4",
        "model.pipeline_splits=[4a]",
    )
    assert {k for k, _ in candidates(cfg)} == {"gpipe", "1f1b", "zb-h1"}

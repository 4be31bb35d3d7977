"""Where the width-minor layout does not apply (`jaxpod.planner.switch_union.
width_minor_read`): probe-f32 (docs/memory.md), the EfficientNet-b0 G4 pod mapping cut to
8 chips of a v5p 2x2x2 slice, depthwise, float32, 128 pixels, 2 images a micro-batch, GPipe,
`model.remat=none`. Its stem's stage's GroupNorm values `[mb, H, W, 4, C/4]` in the
switch's saved values keep the group's channels minor, each taking `group_elements`, and
the plan, which prices them so, is within 10 % of XLA's HBM total.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.dumps import switch_saved

from jaxpod.config import load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.efficientnet_pieces import pieces
from jaxpod.planner.profiles import get_profile
from jaxpod.planner.switch_union import width_minor_read
from jaxpod.planner.tiles import group_elements
from jaxpod.target.hlo_text import shape_bytes

pytestmark = pytest.mark.slow

PROFILE = get_profile("tpu-v5p")
POD = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_pod16.yaml"
PROBE = ("devices=8", "mesh.replica=4", "mesh.pipeline=2", "model.variant=b0")
PROBE += ("model.num_classes=100", "train.batch_parts=1", "model.g16=false")
PROBE += ("model.image_size=128", "train.micro_batch=2", "train.grad_accum=2")
PROBE += ("model.remat=none", "train.pipeline_schedule=gpipe", "precision.params=float32")
PROBE += ("precision.compute=float32", "precision.master=float32", "precision.loss_scale=none")
GROUPED = re.compile(r"f32\[2,(\d+),\1,4,(\d+)\]\{([\d,]+)")


@pytest.fixture(scope="module")
def program():
    """`(cfg, the element shapes of the switch's saved values, XLA's HBM total)`."""
    cfg = load_config(POD, PROBE)
    saved, hbm = switch_saved(cfg, (4, 2, 1), "tpu-v5p:2x2x2")
    return cfg, saved, hbm


def test_the_stem_stage_keeps_the_group_minor(program):
    """Each group-shaped value of a shape the stem's stage saves (64 and 32 pixels) is laid
    out channels-minor (`{4,3,2,1,0}`) and takes `group_elements`."""
    cfg, saved, _ = program
    assert not width_minor_read(cfg)
    stem = {
        (hw, ch) for p in pieces(cfg, 4, 4, PROFILE.tile)[0] for _, hw, ch, _ in p["saved_values"]
    }
    seen = 0
    for shape in saved:
        found = GROUPED.match(shape)
        if not found or (int(found.group(1)), 4 * int(found.group(2))) not in stem:
            continue
        hw, channels = int(found.group(1)), 4 * int(found.group(2))
        if hw not in (64, 32):
            continue
        assert found.group(3) == "4,3,2,1,0", shape
        assert shape_bytes(shape, padded=True) == 2 * 4 * group_elements(
            PROFILE.tile, hw, channels, 4
        )
        seen += 1
    assert seen == 20


def test_the_plan_is_within_10_percent(program):
    """Planned over XLA:TPU's HBM bytes (the memory spaces but VMEM and SMEM)."""
    cfg, _, hbm = program
    acts = activation_bytes(cfg, PROFILE)
    planned = device_bytes(cfg, param_layout(cfg), acts, PROFILE)["device_total"]
    assert 0.9 < planned / hbm < 1.1

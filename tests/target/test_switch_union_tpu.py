"""The switch's saved values pipelined without remat in XLA:TPU's compiled step (libtpu, no
TPU attached; `jaxpod.planner.switch_union`): the EfficientNet-B4 G16 v5e preset's mapping
cut to three block groups (stages: the stem and blocks 1a to 2d, then 3a to the head) at
190 pixels, 2 images a micro-batch, 2 replicas on a v5e 2x2 slice, `model.remat=none`.
The stages' `lax.switch` returns one value per type and branch slot (jax merges the
branches' residuals): block 3a's 48-pixel expand values share the outputs of 2b to 2d's.
The stem's stage's GroupNorm values `[mb, H, W, 4, C/4]` are laid out width-minor, the other
stage's channels-minor, each taking the bytes the planner prices; the plan is within 10 %
of XLA's HBM total with the profile property, far above it without.
"""

from __future__ import annotations

import dataclasses
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
from jaxpod.planner.switch_union import width_minor_elements, width_minor_read
from jaxpod.planner.tiles import group_elements
from jaxpod.target.hlo_text import shape_bytes

pytestmark = pytest.mark.slow

PROFILE = get_profile("tpu-v5e")
PRESET = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_tpu_v5e16.yaml"
PROBE = ("devices=4", "mesh.replica=2", "model.block_groups=3", "model.pipeline_splits=[3a]")
PROBE += ("model.image_size=190", "train.micro_batch=2", "train.grad_accum=4")
PROBE += ("train.batch_parts=1", "model.remat=none")
GROUPED = re.compile(r"f32\[2,(\d+),\1,4,(\d+)\]\{([\d,]+)")


@pytest.fixture(scope="module")
def program():
    """`(cfg, the element shapes of the switch's saved values, XLA's HBM total)`."""
    cfg = load_config(PRESET, PROBE)
    saved, hbm = switch_saved(cfg, (2, 2, 1), "tpu-v5e:2x2")
    return cfg, saved, hbm


def _norm_counts(stage: list[dict]) -> dict:
    """`{(pixels a side, channels): group-shaped values}` a stage saves."""
    counts: dict = {}
    for p in stage:
        for kind, hw, ch, n in p["saved_values"]:
            counts[(hw, ch)] = counts.get((hw, ch), 0) + n * (kind == "group")
    return {key: n for key, n in counts.items() if n}


def test_group_values_are_width_minor_in_the_stem_stage_only(program):
    """Each group-shaped value of a shape only the stem's stage saves is laid out W-minor
    (`{2,...}`) and takes `width_minor_elements`; of a shape only the other stage saves,
    channels-minor (`{4,3,2,1,0}`), `group_elements`."""
    cfg, saved, _ = program
    stem_counts, other_counts = (_norm_counts(st) for st in pieces(cfg, 2, 2, PROFILE.tile))
    stem, other = set(stem_counts), set(other_counts)
    seen = {"stem": 0, "other": 0}
    for shape in saved:
        found = GROUPED.match(shape)
        if not found:
            continue
        hw, per_group = int(found.group(1)), int(found.group(2))
        key, padded = (hw, 4 * per_group), shape_bytes(shape, padded=True)
        if key in stem - other:
            assert found.group(3).startswith("2,"), shape
            assert padded == 2 * 4 * width_minor_elements(PROFILE.tile, hw, key[1], 4), shape
            seen["stem"] += 1
        elif key in other - stem:
            assert found.group(3) == "4,3,2,1,0", shape
            assert padded == 2 * 4 * group_elements(PROFILE.tile, hw, key[1], 4), shape
            seen["other"] += 1
    assert seen["stem"] == sum(stem_counts[k] for k in stem - other) == 22
    assert seen["other"] == sum(other_counts[k] for k in other - stem) == 24


def test_a_type_both_stages_save_is_held_once(program):
    """`f32[2,48,48,4,32]`: 2b to 2d's expand and spatial ConvNorms save 12, 3a's expand 2:
    the switch returns 12."""
    _, saved, _ = program
    assert sum(s.startswith("f32[2,48,48,4,32]{") for s in saved) == 12


def _planned(cfg, profile) -> int:
    acts = activation_bytes(cfg, profile)
    return device_bytes(cfg, param_layout(cfg), acts, profile)["device_total"]


def test_the_plan_is_within_10_percent_with_the_property_only(program):
    """Planned over XLA:TPU's HBM bytes (the memory spaces but VMEM and SMEM): within 10 %
    with the stem's stage's values width-minor, above 1.5 without."""
    cfg, _, hbm = program
    assert width_minor_read(cfg)
    without = dataclasses.replace(PROFILE, stem_groups_width_minor=False)
    assert 0.9 < _planned(cfg, PROFILE) / hbm < 1.1
    assert _planned(cfg, without) / hbm > 1.5

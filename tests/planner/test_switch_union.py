"""The switch's saved values pipelined without remat (`jaxpod.planner.switch_union`): the
pieces' typed values are what `"saved"` counts, the branches' values of one type are held
once (jax merges them), and the stem's stage's group-shaped values are priced width-minor on
a TPU profile where that layout was read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxpod.config import load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.efficientnet_pieces import F32, pieces
from jaxpod.planner.profiles import get_profile
from jaxpod.planner.switch_union import union_saved, width_minor_elements, width_minor_read
from jaxpod.planner.tiles import Tile, group_elements

PRESET = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_tpu_v5e16.yaml"
PROBE = ("devices=4", "mesh.replica=2", "model.block_groups=3", "model.pipeline_splits=[3a]")
PROBE += ("model.image_size=190", "train.micro_batch=2", "train.grad_accum=4")
PROBE += ("train.batch_parts=1", "model.remat=none")
POD = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_pod16.yaml"
B0_PROBE = ("devices=8", "mesh.replica=4", "mesh.pipeline=2", "model.variant=b0")
B0_PROBE += ("model.num_classes=100", "train.batch_parts=1", "model.g16=false")
B0_PROBE += ("model.image_size=128", "train.micro_batch=2", "train.grad_accum=2")
B0_PROBE += ("model.remat=none", "train.pipeline_schedule=gpipe", "precision.params=float32")
B0_PROBE += ("precision.compute=float32", "precision.master=float32")
B0_PROBE += ("precision.loss_scale=none",)


def _probe():
    return load_config(PRESET, PROBE)


def test_typed_values_are_what_saved_counts():
    """Each piece's `"saved_values"` priced unmerged add up to its `"saved"`, padded or not."""
    cfg = _probe()
    for tile in (None, Tile()):
        for stage in pieces(cfg, 2, 2, tile):
            for piece in stage:
                alone = union_saved([[piece]], 1, 2, tile, cfg.model.norm_groups, False)
                assert alone == piece["saved"], piece["name"]


def test_a_type_two_stages_save_is_held_once():
    """Block 3a (stage 1) expands at 48 pixels to 128 channels, the shapes of blocks 2b to
    2d's expand and spatial ConvNorms (stage 0): the union is the two stages' sum less 3a's
    expand values (2 group-shaped, 1 float32, 4 in the compute dtype)."""
    cfg = _probe()
    stages = pieces(cfg, 2, 2, None)
    mb, groups = cfg.train.micro_batch, cfg.model.norm_groups
    both = sum(union_saved([st], mb, 2, None, groups, False) for st in stages)
    shared = mb * 48 * 48 * 128 * (2 * F32 + F32 + 4 * 2)
    assert union_saved(stages, mb, 2, None, groups, False) == both - shared


def test_width_minor_pads_the_width_not_the_group():
    """`[95, 95, 4, 12]` takes 96 rows of H by 128 lanes of W per group channel (XLA's
    `{2,1,4,3,0}`); `[48, 48, 4, 32]` 48 x 4 x 32 rows of C/G by 128 (`{2,4,3,1,0}`):
    against 10.7 and 4 times the logical channels-minor."""
    tile = Tile()
    assert width_minor_elements(tile, 95, 48, 4) == 48 * 96 * 128
    assert width_minor_elements(tile, 48, 128, 4) == 48 * 4 * 32 * 128
    assert group_elements(tile, 95, 48, 4) == 95 * 95 * 4 * 128


def test_tpu_prices_only_the_stem_stage_width_minor():
    """On a TPU profile the stem's stage's group-shaped values are priced width-minor, the
    other stage's as before; XLA:CPU's profile does not have the property."""
    cfg = _probe()
    tile, groups, mb = get_profile("tpu-v5e").tile, cfg.model.norm_groups, 2
    assert get_profile("tpu-v5e").stem_groups_width_minor
    assert not get_profile("cpu").stem_groups_width_minor
    stem, other = pieces(cfg, 2, 2, tile)
    assert union_saved([other], mb, 2, tile, groups, True) == union_saved(
        [other], mb, 2, tile, groups, False
    )
    narrow = union_saved([stem], mb, 2, tile, groups, False)
    assert union_saved([stem], mb, 2, tile, groups, True) < narrow / 2


def test_width_minor_applies_where_it_was_read_only():
    """B4 G16 is priced width-minor under 1F1B and GPipe; with depthwise convs and in
    probe-f32's b0 mapping (channels-minor in its program) it is not: its plan on `tpu-v5p`
    is the plan without the property."""
    assert width_minor_read(_probe())
    assert width_minor_read(load_config(PRESET, PROBE + ("train.pipeline_schedule=gpipe",)))
    assert not width_minor_read(load_config(PRESET, PROBE + ("model.g16=false",)))
    b0 = load_config(POD, B0_PROBE)
    assert not width_minor_read(b0)
    v5p = get_profile("tpu-v5p")
    without = dataclasses.replace(v5p, stem_groups_width_minor=False)
    assert activation_bytes(b0, v5p) == activation_bytes(b0, without)

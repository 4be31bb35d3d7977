"""The grouped convs' copies (`jaxpod.planner.grouped_convs`): their tiled bytes, which pieces
have them, and that only the TPU profiles count them, at the stem stage's peak."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxpod.config import load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.efficientnet_pieces import pieces
from jaxpod.planner.grouped_convs import grouped_conv_bytes, grouped_elements
from jaxpod.planner.profiles import PROFILES, get_profile
from jaxpod.planner.tiles import Tile

TILE = Tile()
PRESET = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_tpu_v5e16.yaml"


def test_the_batch_is_second_minor_and_a_group_minor():
    """3 bfloat16 images take 4 rows (`T(4,128)(2,1)`), 2 take 2, 16 or 12 channels 128
    lanes: a B4 block's 96 channels at 190 pixels, as XLA:TPU's `bf16[3,190,190,6,16]`
    (221.8 MB)."""
    assert grouped_elements(TILE, 3, 190, 96, 16, 2) == 190 * 190 * 6 * 4 * 128
    assert 2 * grouped_elements(TILE, 3, 190, 96, 16, 2) == 221_798_400
    assert grouped_elements(TILE, 2, 95, 24, 12, 2) == 95 * 95 * 2 * 2 * 128
    assert grouped_elements(TILE, 3, 95, 128, 16, 4) == 95 * 95 * 8 * 4 * 128


def test_each_grouped_conv_counts_its_operand_and_cotangent():
    """Block 2a of B4 (96 channels, stride 2: 190 to 95 pixels) counts a copy at each size;
    the stem and the head have no grouped conv."""
    cfg = load_config(PRESET, ["model.block_groups=2", "model.pipeline_splits=[2a]"])
    stem_stage, last = pieces(cfg, 2, 2, TILE)
    assert [p.get("grouped_conv") for p in stem_stage] == [None, (190, 190, 48, 16)] + [
        (190, 190, 24, 12)
    ]
    assert last[0]["grouped_conv"] == (190, 95, 96, 16)
    assert last[-1].get("grouped_conv") is None
    a = 2 * grouped_elements(TILE, 3, 190, 96, 16, 2) + 2 * grouped_elements(TILE, 3, 95, 96, 16, 2)
    assert grouped_conv_bytes(last[:1], 3, 2, TILE) == a


def test_only_the_tpu_profiles_count_them_at_the_stem_stage():
    """The TPU profiles hold the copies; the plan for one without them is less by the stem
    stage's copies (its peak), with the tile's padding."""
    held = {n for n, p in PROFILES.items() if p.grouped_conv_copies}
    assert held == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}
    cfg = load_config(PRESET, [])
    profile = get_profile("tpu-v5e")
    without = dataclasses.replace(profile, grouped_conv_copies=False)
    stem_stage = pieces(cfg, 2, 2, TILE)[0]
    extra = grouped_conv_bytes(stem_stage, cfg.train.micro_batch, 2, TILE)
    with_copies = activation_bytes(cfg, profile)["layer_work"]
    assert with_copies - activation_bytes(cfg, without)["layer_work"] == extra
    assert extra > 1_000_000_000  # the v5e-16 preset: 1.27 GB of copies

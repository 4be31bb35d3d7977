"""The planner's tile arithmetic (`jaxpod.planner.tiles`) against the bytes XLA:TPU's layouts
give the same arrays (`jaxpod.target.hlo_text.shape_bytes(..., padded=True)`), and what the
TPU profiles' tile adds to EfficientNet's byte model."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import digits_cfg

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.efficientnet import carry_size
from jaxpod.planner.efficientnet_pieces import pieces
from jaxpod.planner.plan import plan
from jaxpod.planner.profiles import PROFILES, get_profile
from jaxpod.planner.tiles import Tile, group_elements, image_elements
from jaxpod.target.hlo_text import shape_bytes

TILE = Tile()
# Layouts as XLA:TPU's compiled EfficientNet steps print them (v5e, v5p): activations with
# channels minor, GroupNorm's group-shaped values, the uint8 image batch's copy, a packed
# 16-bit row, the float32 carry, small second-minor dimensions
LAYOUTS = [
    "f32[2,128,128,3]{3,2,1,0:T(8,128)}",
    "f32[2,64,64,4,8]{4,3,2,1,0:T(4,128)}",
    "f32[2,64,64,96]{3,2,1,0:T(8,128)}",
    "bf16[2,128,128,3]{3,2,1,0:T(8,128)(2,1)}",
    "u8[8,96,96,3]{3,2,1,0:T(8,128)(4,1)}",
    "bf16[1,4594270]{1,0:T(2,128)(2,1)}",
    "f32[2,12288]{1,0:T(2,128)}",
    "f32[2,5,100]{2,1,0:T(8,128)}",
    "bf16[2,3,200]{2,1,0:T(4,128)(2,1)}",
]
ITEMSIZE = {"f32": 4, "bf16": 2, "u8": 1}


@pytest.mark.parametrize("shape", LAYOUTS)
def test_the_tile_pads_as_the_layouts_do(shape):
    dtype, dims = shape.split("[")[0], shape.split("[")[1].split("]")[0]
    dims = tuple(int(d) for d in dims.split(","))
    n = ITEMSIZE[dtype]
    assert TILE.padded(dims, n) * n == shape_bytes(shape, padded=True)


def test_tile_arithmetic_by_hand():
    assert TILE.padded((2, 128, 128, 3)) == 2 * 128 * 128 * 128  # 3 channels take 128
    assert TILE.padded((12, 200)) == 16 * 256
    assert [TILE.rows_of(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [TILE.rows_of(1, 2), TILE.rows_of(1, 1), TILE.rows_of(3, 1)] == [2, 4, 4]
    assert TILE.padded((7,)) == 7
    # unpadded without a tile; a group-shaped value pads one group's channels
    assert image_elements(None, 32, 24) == 32 * 32 * 24 == group_elements(None, 32, 24, 4)
    assert image_elements(TILE, 32, 24) == 32 * 32 * 128
    assert group_elements(TILE, 32, 24, 4) == 32 * 32 * 4 * 128


def test_only_tpu_profiles_have_a_tile():
    tiled = {name for name, p in PROFILES.items() if p.tile is not None}
    assert tiled == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}


def _digits(*overrides: str):
    return digits_cfg("memory.device=tpu-v5p", *overrides)


def test_padding_grows_the_image_terms_and_leaves_the_carry():
    """The stem's image is 3 channels: 128 / 3 times its bytes once tiled; every piece's
    bytes grow or stay; the carry (a flat float32 row) is the same."""
    cfg = _digits()
    plain, tiled = pieces(cfg, 2, 2), pieces(cfg, 2, 2, TILE)
    hw = cfg.model.image_size
    assert plain[0][0]["image"] == hw * hw * 3
    assert tiled[0][0]["image"] == hw * TILE.rows_of(hw) * 128
    assert carry_size(tiled) == carry_size(plain)
    for stage_plain, stage_tiled in zip(plain, tiled, strict=True):
        for a, b in zip(stage_plain, stage_tiled, strict=True):
            assert all(b[k] >= a[k] for k in ("kept", "forward", "saved"))
    assert tiled[0][0]["saved"] > plain[0][0]["saved"]


def _input_copy(cfg, name: str) -> int:
    profile = get_profile(name)
    acts = activation_bytes(cfg, profile)
    return device_bytes(cfg, param_layout(cfg), acts, profile)["input_copy"]


def test_the_image_batch_is_copied_into_tiles_for_stepwise_ticks_on_tpu_only():
    """On a TPU profile a stepwise pipeline holds the uint8 batch's tiled copy through the
    step: `[G, H, W, 3]` with 3 channels padded to 128, beside the batch itself; GPipe's
    ticks read the batch as it is, and a CPU device copies nothing."""
    cfg = _digits("train.pipeline_schedule=1f1b")
    hw, images = cfg.model.image_size, cfg.part_micro * cfg.train.micro_batch
    expected = images * hw * TILE.rows_of(hw) * 128 * np.dtype(np.uint8).itemsize
    assert _input_copy(cfg, "tpu-v5p") == expected
    assert _input_copy(cfg, "cpu") == 0
    assert _input_copy(_digits("train.pipeline_schedule=gpipe"), "tpu-v5p") == 0
    assert plan(cfg)["bytes_per_device"]["inputs"] == images * hw * hw * 3

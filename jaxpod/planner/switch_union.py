"""The values the stages' `lax.switch` saves pipelined without remat, one set per shape.
Jax-free.

Pipelined without remat, the tick's `lax.switch` over the stages is linearized as a whole:
it returns what every branch's backward reads (`jaxpod.planner.efficientnet`). jax merges
the branches' residuals by type (`_merge_branch_residuals` in jax's `conditionals.py`): a
branch's k-th value of a shape and dtype takes the same output as another branch's k-th,
so the switch returns, per type, the most values of it any one branch saves, not their sum
(`union_saved`). The values are the pieces' `"saved_values"`, as `_saved_convnorm` counts
them: per ConvNorm two float32 group-shaped values `[mb, H, W, G, C/G]`, one float32 and
one to four of the compute dtype `[mb, H, W, C]`.

XLA:TPU lays out the stem's stage's group-shaped values width-minor in EfficientNet-B4 G16
(cut to three block groups, v5e 2x2; 1F1B at 190, 128 and 96 pixels, GPipe at 128): W takes
the lanes and the second-minor dimension is H or C/G, whichever the rows pad less
(`{2,1,4,3,0}` or `{2,4,3,1,0}`); the other stage's keep the group's channels minor, as the
tile's arithmetic pads them (`group_elements`). EfficientNet-b0 on v5p 2x2x2 keeps both
stages' channels-minor (GPipe and 1F1B, G16 or depthwise, float32 or bfloat16, 128 and 96
pixels); b0 in B4's cut on v5e mixes the two. What decides it is not read, so the property
applies to B4 G16 only (`width_minor_read`). `DeviceProfile.stem_groups_width_minor`;
tests/target/test_switch_union_tpu.py and test_switch_union_b0_tpu.py find both.
"""

from __future__ import annotations

from collections import Counter

from jaxpod.config.efficientnet_specs import norm_groups
from jaxpod.planner.tiles import Tile, group_elements, image_elements

F32 = 4


def width_minor_read(cfg) -> bool:
    """Whether `cfg` is the case the width-minor layout was read on: EfficientNet-B4 G16,
    under 1F1B and GPipe (b0's programs keep the group's channels minor, or mix the two)."""
    model = cfg.model
    return model.variant == "b4" and model.g16


def width_minor_elements(tile: Tile, hw: int, channels: int, groups: int) -> int:
    """Elements per image of a float32 `[H, W, G, C/G]` value laid out width-minor: W padded
    to the lanes, H or C/G (the one padded less) to the rows."""
    per_group = channels // groups
    rows_h = groups * per_group * tile.rows_of(hw) * tile.lanes_of(hw)
    rows_c = hw * groups * tile.rows_of(per_group) * tile.lanes_of(hw)
    return min(rows_h, rows_c)


def _price(kind: str, hw: int, channels: int, act: int, tile: Tile | None, groups: int, wide):
    """Bytes per image of one saved value (`wide`: a group-shaped one is laid out
    width-minor)."""
    if kind == "act":
        return act * image_elements(tile, hw, channels)
    if kind == "f32":
        return F32 * image_elements(tile, hw, channels)
    g = norm_groups(channels, groups)
    if wide and tile is not None:
        return F32 * width_minor_elements(tile, hw, channels, g)
    return F32 * group_elements(tile, hw, channels, g)


def union_saved(
    stages: list[list[dict]], mb: int, act: int, tile: Tile | None, groups: int, wide: bool
) -> int:
    """Bytes of the switch's saved values for a micro-batch of `mb` images: per type, the
    largest of the stages' values of it (`act`: the compute dtype's bytes; `groups`:
    `model.norm_groups`; `wide`: the stem's stage's group-shaped values laid out
    width-minor)."""
    largest: Counter = Counter()
    for stage in stages:
        held: Counter = Counter()
        stem = wide and stage[0]["name"] == "stem"
        for piece in stage:
            for kind, hw, channels, count in piece["saved_values"]:
                held[(kind, hw, channels)] += (
                    count * mb * _price(kind, hw, channels, act, tile, groups, stem)
                )
        for key, total in held.items():
            largest[key] = max(largest[key], total)
    return sum(largest.values())

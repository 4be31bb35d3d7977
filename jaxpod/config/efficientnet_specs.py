"""EfficientNet's architecture as data (jax-free): variants, compound scaling, MBConv block
specs, where a pipeline cuts the block sequence, and FLOPs per image.

Block names follow the reference: `"4a"` is the first block of block group 4 (a group is a
run of blocks at one resolution and width; the paper calls it a stage, a word jaxpod keeps
for pipeline stages).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

# variant -> (width coefficient, depth coefficient, resolution)
VARIANTS: dict[str, tuple[float, float, int]] = {
    "b0": (1.0, 1.0, 224),
    "b1": (1.0, 1.1, 240),
    "b2": (1.1, 1.2, 260),
    "b3": (1.2, 1.4, 300),
    "b4": (1.4, 1.8, 380),
}

# B0 block groups: (expand, kernel, stride, in_ch, out_ch, repeats); squeeze-excitation ratio 0.25.
BASE_BLOCK_GROUPS: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)
STEM_CH = 32
HEAD_CH = 1280
SE_RATIO = 0.25
G16_GROUP_SIZE = 16
G16_EXPAND = 4  # expansion 6 -> 4 in the G16 variant
IMAGE_CH = 3


def round_filters(filters: int, width: float, divisor: int = 8) -> int:
    """Channels scaled by `width`, rounded to a multiple of `divisor`, never more than 10 %
    below `filters * width` (the reference rule)."""
    scaled = filters * width
    rounded = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * scaled:
        rounded += divisor
    return int(rounded)


def round_repeats(repeats: int, depth: float) -> int:
    """Block repeats scaled by `depth`: `ceil(depth * repeats)`."""
    return int(math.ceil(depth * repeats))


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is <= `limit` (>= 1)."""
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


def norm_groups(channels: int, groups: int) -> int:
    """GroupNorm group count used for `channels`: `groups` if it divides `channels`, else the
    largest divisor of `channels` that is <= `groups`."""
    return largest_divisor_at_most(channels, groups)


def g16_group_size(channels: int) -> int:
    """Channels per group of a G16 spatial conv: 16 if it divides `channels`, else the largest
    divisor of `channels` that is <= 16 (so `channels < 16` gives a single full group)."""
    return largest_divisor_at_most(channels, G16_GROUP_SIZE)


@dataclass(frozen=True)
class BlockSpec:
    """One MBConv block. `group_size` is the channels per group of the spatial conv (1 =
    depthwise); `expand` the expansion ratio of the (optional, `expand > 1`) 1x1 conv."""

    name: str
    in_ch: int
    out_ch: int
    kernel: int
    stride: int
    expand: int
    group_size: int

    @property
    def mid_ch(self) -> int:
        """Channels of the expanded activation (the spatial conv's width)."""
        return self.in_ch * self.expand

    @property
    def feature_groups(self) -> int:
        """`feature_group_count` of the spatial conv."""
        return self.mid_ch // self.group_size

    @property
    def se_ch(self) -> int:
        """Squeeze-excitation bottleneck width: `max(1, int(in_ch * 0.25))`."""
        return max(1, int(self.in_ch * SE_RATIO))

    @property
    def residual(self) -> bool:
        """Identity skip connection (stride 1 and `in_ch == out_ch`)."""
        return self.stride == 1 and self.in_ch == self.out_ch


def _variant(variant: str) -> tuple[float, float, int]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown EfficientNet variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def coefficients(variant: str, width_mult: float | None, depth_mult: float | None):
    """`(width, depth)`: the variant's compound-scaling coefficients, or the overrides."""
    width, depth, _ = _variant(variant)
    return (width if width_mult is None else width_mult), (
        depth if depth_mult is None else depth_mult
    )


def stem_head_channels(variant: str, *, width_mult: float | None = None) -> tuple[int, int]:
    """`(stem_ch, head_ch)`: output channels of the stem conv and of the head 1x1 conv."""
    width, _ = coefficients(variant, width_mult, None)
    return round_filters(STEM_CH, width), round_filters(HEAD_CH, width)


def default_image_size(variant: str) -> int:
    """The variant's published training resolution (any size >= 32 works)."""
    return _variant(variant)[2]


def shape_options(md) -> dict:
    """The model config `md`'s fields that shape its blocks (`g16`, `width_mult`,
    `depth_mult`, `block_groups`), as keywords of `block_specs`, `flops_per_image` and
    `stage_params`."""
    return {
        "g16": md.g16,
        "width_mult": md.width_mult,
        "depth_mult": md.depth_mult,
        "block_groups": md.block_groups,
    }


def model_block_specs(md) -> list[BlockSpec]:
    """`block_specs` of the model config `md` (its variant and `shape_options`)."""
    return block_specs(md.variant, **shape_options(md))


def block_specs(
    variant: str,
    *,
    g16: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
    block_groups: int | None = None,
) -> list[BlockSpec]:
    """The MBConv blocks of `variant` in order; `width_mult`/`depth_mult` override its
    compound-scaling coefficients; `block_groups` keeps only the first that many of the seven
    block groups (a shallower network, for tests and quick trials; None: all). The first block
    of a group has the group's stride and input width; its repeats have stride 1 and
    `in_ch == out_ch`."""
    width, depth = coefficients(variant, width_mult, depth_mult)
    specs = []
    for block_group, (expand, kernel, stride, c_in, c_out, repeats) in enumerate(
        BASE_BLOCK_GROUPS[:block_groups], 1
    ):
        c_in, c_out = round_filters(c_in, width), round_filters(c_out, width)
        if g16 and expand == 6:
            expand = G16_EXPAND
        for i in range(round_repeats(repeats, depth)):
            in_ch = c_in if i == 0 else c_out
            group_size = g16_group_size(in_ch * expand) if g16 else 1
            specs.append(
                BlockSpec(
                    name=f"{block_group}{string.ascii_lowercase[i]}",
                    in_ch=in_ch,
                    out_ch=c_out,
                    kernel=kernel,
                    stride=stride if i == 0 else 1,
                    expand=expand,
                    group_size=group_size,
                )
            )
    return specs


def split_specs(specs: Sequence[BlockSpec], splits: Sequence[str]) -> list[list[BlockSpec]]:
    """Cut `specs` before each block named in `splits` (strictly increasing): `len(splits)+1`
    runs (a run may be empty: `splits=["1a"]` makes stage 0 the stem alone).

    Raises ValueError naming the valid block names for an unknown or out-of-order split."""
    names = [s.name for s in specs]
    valid = f"valid block names: {', '.join(names)}"
    cuts = []
    for name in splits:
        if name not in names:
            raise ValueError(f"unknown split block {name!r}; {valid}")
        cut = names.index(name)
        if cuts and cut <= cuts[-1]:
            raise ValueError(f"splits must be strictly increasing, got {list(splits)}; {valid}")
        cuts.append(cut)
    bounds = [0, *cuts, len(specs)]
    return [list(specs[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def flops_per_image(
    variant: str = "b0",
    image_size: int | None = None,
    num_classes: int = 1000,
    *,
    g16: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
    block_groups: int | None = None,
) -> int:
    """Forward FLOPs of one image, counted as 2 x multiply-adds of every conv and dense layer
    (stem, expand, spatial, squeeze-excitation, project, head, classifier). Norms,
    activations, pools, the SE gating multiply and residual adds are not counted. (Published
    "0.39B FLOPs" for B0 are multiply-adds, i.e. ~0.78e9 here.) `image_size` defaults to the
    variant's resolution."""
    size = default_image_size(variant) if image_size is None else image_size
    specs = block_specs(
        variant, g16=g16, width_mult=width_mult, depth_mult=depth_mult, block_groups=block_groups
    )
    stem_ch, head_ch = stem_head_channels(variant, width_mult=width_mult)

    def conv(hw: int, k: int, c_in: int, c_out: int, groups: int = 1) -> int:
        return 2 * hw * hw * k * k * (c_in // groups) * c_out

    hw = -(-size // 2)
    total = conv(hw, 3, IMAGE_CH, stem_ch)
    for s in specs:
        if s.expand != 1:
            total += conv(hw, 1, s.in_ch, s.mid_ch)
        hw = -(-hw // s.stride)
        total += conv(hw, s.kernel, s.mid_ch, s.mid_ch, s.feature_groups)
        total += 2 * 2 * s.mid_ch * s.se_ch
        total += conv(hw, 1, s.mid_ch, s.out_ch)
    total += conv(hw, 1, specs[-1].out_ch, head_ch) + 2 * head_ch * num_classes
    return int(total)


def stage_params(
    variant: str = "b0",
    *,
    splits: Sequence[str] = (),
    num_classes: int = 1000,
    g16: bool = False,
    width_mult: float | None = None,
    depth_mult: float | None = None,
    block_groups: int | None = None,
) -> list[int]:
    """Parameter scalars of each pipeline stage (`splits` as in `split_specs`), counted from
    the specs: every conv kernel `[k, k, in / groups, out]` (no bias) with its norm's scale
    and bias, the squeeze-excitation's two dense layers with biases, the stem in stage 0,
    the head conv and classifier in the last stage (tests/models: equal to the modules')."""
    specs = block_specs(
        variant, g16=g16, width_mult=width_mult, depth_mult=depth_mult, block_groups=block_groups
    )
    stem_ch, head_ch = stem_head_channels(variant, width_mult=width_mult)

    def conv_norm(c_in: int, c_out: int, k: int, groups: int = 1) -> int:
        return k * k * (c_in // groups) * c_out + 2 * c_out

    def block(s: BlockSpec) -> int:
        n = conv_norm(s.in_ch, s.mid_ch, 1) if s.expand != 1 else 0
        n += conv_norm(s.mid_ch, s.mid_ch, s.kernel, s.feature_groups)
        n += 2 * s.mid_ch * s.se_ch + s.se_ch + s.mid_ch  # reduce and expand, with biases
        return n + conv_norm(s.mid_ch, s.out_ch, 1)

    counts = [sum(block(s) for s in run) for run in split_specs(specs, splits)]
    counts[0] += conv_norm(IMAGE_CH, stem_ch, 3)
    counts[-1] += conv_norm(specs[-1].out_ch, head_ch, 1) + (head_ch + 1) * num_classes
    return counts

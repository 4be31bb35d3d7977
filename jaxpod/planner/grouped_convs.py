"""The grouped convolutions' copies XLA:TPU holds for their weight gradients. Jax-free.

XLA:TPU computes a grouped convolution (EfficientNet's G16 spatial convs: groups of 16 or
12 channels) on its values laid out `[B, H, W, groups, group size]` with the group's
channels minor and the micro-batch second-minor (layout `{4,0,3,2,1:T(4,128)(2,1)}` for 3
bfloat16 images): 16 channels take 128 lanes and 3 images 4 rows, 10.7 times the logical
bytes. Beside its image-layout values, a recomputed stage's backward holds two such copies
per grouped conv in the compute dtype, its operand (the recomputed swish, or the block
input) and its output's cotangent, each until the conv's weight gradient, late in the
stage's backward: the planner counts all of them at the stem stage's weight-gradient peak
(`DeviceProfile.grouped_conv_copies`). On a v5p probe (no VMEM heap) all of them are alive
at one moment, beside the first block's data gradient; on v5e some sit in VMEM.
Depthwise convs (groups of one channel) are not counted: no program read had one.
tests/target/test_grouped_tpu.py finds the copies in a compiled B4 step.
"""

from __future__ import annotations

from jaxpod.planner.tiles import Tile


def grouped_elements(tile: Tile, mb: int, hw: int, channels: int, group: int, itemsize: int) -> int:
    """Elements of a `[mb, hw, hw, channels / group, group]` value of `itemsize`-byte
    elements laid out as a grouped conv's: `group` minor, the micro-batch second-minor."""
    return tile.padded((hw, hw, channels // group, mb, group), itemsize)


def grouped_conv_bytes(stage: list[dict], mb: int, act: int, tile: Tile) -> int:
    """Bytes of the grouped-layout copies of every grouped conv of `stage` (pieces with
    `"grouped_conv"`: `(input pixels a side, output pixels a side, channels, group size)`)
    for a micro-batch of `mb` images in the compute dtype of `act` bytes: each conv's
    operand at its input's size and its output's cotangent at its output's."""
    total = 0
    for piece in stage:
        if piece.get("grouped_conv") is None:
            continue
        h_in, h_out, channels, group = piece["grouped_conv"]
        for hw in (h_in, h_out):
            total += act * grouped_elements(tile, mb, hw, channels, group, act)
    return total

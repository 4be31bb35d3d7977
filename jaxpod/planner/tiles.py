"""The tiles XLA:TPU lays arrays out in: the elements an array takes once its layout pads it.
Jax-free.

XLA:TPU tiles an array over its two minor-most dimensions (in layout order): the minor one
is padded to a multiple of 128 lanes, the second-minor to a multiple of 8 rows, 2-byte and
1-byte dtypes included (their layouts `T(8,128)(2,1)` and `T(8,128)(4,1)` pack 2 or 4
elements into one 32-bit word, still 8 rows to a tile). A second-minor dimension below 8
gets the smallest power-of-two tile that holds it (`T(1,128)`, `T(2,128)`, `T(4,128)`), at
least one 32-bit word's rows (2 for 2-byte dtypes, 4 for 1-byte).
A convolution's activations `[B, H, W, C]` keep their channels minor and their width
second-minor, so 3 to 48 channels take 128; GroupNorm's group-shaped float32 values
`[B, H, W, G, C/G]` keep the channels of one group minor. Read off the compiled program's
layouts by tests/target/test_tiles_tpu.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    """An array tile: `rows` of the second-minor dimension by `lanes` of the minor one."""

    rows: int = 8
    lanes: int = 128

    def rows_of(self, n: int, itemsize: int = 4) -> int:
        """`n` (a second-minor dimension of `itemsize`-byte elements) padded to its tile: a
        multiple of `rows`, or below `rows` the power of two holding it and one word's rows."""
        if n >= self.rows:
            return math.ceil(n / self.rows) * self.rows
        return max(1 << (n - 1).bit_length(), 4 // itemsize)

    def lanes_of(self, n: int) -> int:
        """`n` (a minor dimension) padded to a multiple of `lanes`."""
        return math.ceil(n / self.lanes) * self.lanes

    def padded(self, dims: tuple[int, ...], itemsize: int = 4) -> int:
        """Elements of an array of `dims` (row-major: the last minor) once tiled."""
        if len(dims) < 2:
            return math.prod(dims)  # 1-D: tiled in blocks of at most 1024, counted unpadded
        *lead, second, minor = dims
        return math.prod(lead) * self.rows_of(second, itemsize) * self.lanes_of(minor)


def image_elements(tile: Tile | None, hw: int, channels: int) -> int:
    """Elements per image of an `[H, W, C]` activation (`hw` pixels a side, channels minor),
    padded to `tile` (None: unpadded) as a 4-byte value's (a 16-bit one one pixel wide takes
    2 rows, not 1: the only difference, and a small one)."""
    if tile is None:
        return hw * hw * channels
    return tile.padded((hw, hw, channels))


def group_elements(tile: Tile | None, hw: int, channels: int, groups: int) -> int:
    """Elements per image of a GroupNorm's group-shaped value `[H, W, G, C/G]`, padded to
    `tile` (None: unpadded): each group's channels minor, the groups second-minor."""
    if tile is None:
        return hw * hw * channels
    return hw * hw * tile.padded((groups, channels // groups))

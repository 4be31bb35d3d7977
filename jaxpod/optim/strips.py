"""How the 16-bit update cuts one tensor into strips (jax-free: the planner uses it).

A block is a *strided* slice: the chosen axis of size n is viewed as `[n / B, B]` and block
`b` is column `b` of that view. Whatever mesh axes shard the chosen axis, every device holds
`n / k` contiguous entries of it; when `k · B` divides n, that view keeps the sharding on
its major part, so each device's block is a slice of its own shard and no data moves.
k divides the device count, hence the rule below.
"""

from __future__ import annotations

import math

MAX_BLOCKS = 8
MIN_BLOCK = 1 << 16  # elements: smaller tensors are updated whole (a loop costs more than it saves)


def update_blocks(
    shape: tuple[int, ...], devices: int, leading: bool, min_block: int = MIN_BLOCK
) -> tuple[int, int]:
    """`(axis, blocks)` for updating a tensor of global `shape` in blocks on `devices`
    devices: the most blocks (a power of two <= MAX_BLOCKS) whose size stays >= `min_block`
    elements, on the largest axis that `blocks * devices` divides; `(-1, 1)`: no blocking.
    `leading`: the tensor is one layer of every pipeline stage, `[stages, ...]`; axis 0 is
    never chosen and the size counts one layer."""
    axes = range(1 if leading else 0, len(shape))
    elements = math.prod(shape[a] for a in axes)
    by_size = sorted(axes, key=lambda a: -shape[a])
    blocks = MAX_BLOCKS
    while blocks > 1:
        if elements // blocks >= min_block:
            for axis in by_size:
                if shape[axis] % (blocks * devices) == 0:
                    return axis, blocks
        blocks //= 2
    return -1, 1

"""How the 16-bit update cuts one tensor into strips (jax-free: the planner uses it).

A strip is a *strided* slice: the chosen axis of size n is viewed as `[n / B, B]` and strip
`b` is column `b` of that view. Whatever mesh axes shard the chosen axis, every device holds
`n / k` contiguous entries of it; when `k · B` divides n, that view keeps the sharding on
its major part, so each device's strip is a slice of its own shard and no data moves.
k divides the device count, hence the rule below.
"""

from __future__ import annotations

import math

MAX_STRIPS = 8
MIN_STRIP = 1 << 16  # elements: smaller tensors are updated whole (a loop costs more than it saves)


def strips(
    shape: tuple[int, ...], devices: int, leading: bool, min_strip: int = MIN_STRIP
) -> tuple[int, int]:
    """`(axis, count)` for updating a tensor of global `shape` in strips on `devices`
    devices: the most strips (a power of two <= MAX_STRIPS) whose size stays >= `min_strip`
    elements, on the largest axis that `count * devices` divides; `(-1, 1)`: updated whole.
    `leading`: the tensor is one layer of every pipeline stage, `[stages, ...]`; axis 0 is
    never chosen and the size counts one layer."""
    axes = range(1 if leading else 0, len(shape))
    elements = math.prod(shape[a] for a in axes)
    by_size = sorted(axes, key=lambda a: -shape[a])
    count = MAX_STRIPS
    while count > 1:
        if elements // count >= min_strip:
            for axis in by_size:
                if shape[axis] % (count * devices) == 0:
                    return axis, count
        count //= 2
    return -1, 1

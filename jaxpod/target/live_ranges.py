"""The temporaries of a compiled program and when each is alive, from XLA's dump
(`xla_dump_to`): its buffer assignment (each temporary's size, offset and shape) and its
live ranges (positions in the flattened schedule: loop bodies precede their loop). Read the
values a program holds at a moment, and the bytes they cover (`covered`). Jax-free.
"""

from __future__ import annotations

import glob
import re

VALUE = re.compile(r"value: <\d+ (\S+?)(?: \(phi\))? @0> \(size=(\d+),offset=(\d+)\): (\S+)")


def temporaries(
    dump: str, module: str = "jit_train_step", device_only: bool = False
) -> tuple[dict, dict, dict]:
    """`(values, live ranges, schedule)` of `module`'s preallocated temporaries in the dump
    folder `dump`: name -> (size, offset, shape), name -> (first, last) position, position ->
    name. With `device_only`, those of the default memory space only (XLA:TPU also assigns
    temporaries in the chip's scratch memories, allocations of another `color`)."""
    assignment = glob.glob(f"{dump}/*{module}*buffer-assignment.txt")[0]
    live_range = glob.glob(f"{dump}/*{module}*live-range.txt")[0]
    values, in_temp = {}, False
    for line in open(assignment):
        if line.startswith("allocation"):
            in_temp = "preallocated-temp" in line and not (device_only and "color" in line)
        m = VALUE.search(line)
        if m and in_temp:
            values[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    ranges, schedule, part = {}, {}, None
    for line in open(live_range):
        part = "seq" if "InstructionSequence" in line else part
        part = "ranges" if "BufferLiveRange" in line else part
        part = None if "Live ranges at" in line else part
        if part == "seq" and (m := re.match(r"\s+(\d+):(\S+)", line)):
            schedule[int(m.group(1))] = m.group(2)
        elif part == "ranges" and (m := re.match(r"\s+(\S+):(\d+)-(\d+)", line)):
            name = m.group(1).removesuffix("{}")
            if name in values:
                ranges[name] = (int(m.group(2)), int(m.group(3)))
    return values, ranges, schedule


def covered(values: dict, ranges: dict, t: int) -> int:
    """Bytes of the temporary allocation covered by the values of `ranges` alive at position
    `t` (values sharing bytes, a loop carry and its aliases, counted once)."""
    spans = sorted(
        (values[v][1], values[v][1] + values[v][0]) for v, (a, b) in ranges.items() if a <= t <= b
    )
    total, end = 0, -1
    for start, stop in spans:
        if stop > end:
            total, end = total + stop - max(start, end), stop
    return total

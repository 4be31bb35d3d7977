"""An optimized HLO module's text, read line by line: its computations, their instructions in
schedule order, and the shapes with their layouts and memory spaces. Jax-free;
`jaxpod.target.hlo` summarises what the program does, `jaxpod.target.hlo_runs` how often.

The text is `compiled.as_text()`: one computation per block, `%name (params) -> type {` or
`ENTRY %name ...`, closed by `}`; one instruction per line, `[ROOT] %x = TYPE op(operands),
attributes`, TYPE an array `f32[2,64]{1,0:T(2,128)S(5)}` (dims, then the layout: minor-to-major
dimension order, tiles `T(..)`, memory space `S(n)`) or a tuple of them. In a scheduled
module (`is_scheduled=true`) a computation's instruction order is its schedule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# an array shape: dtype, dims, optional layout
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(.*->.*\{\s*$")
_LINE = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s+=\s+(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9-]*)\(")
_NAME = re.compile(r"%([^\s,(){}]+)")
_ONE_CALL = re.compile(r"\b(\w+)=%([^\s,{}]+)")
_MANY_CALLS = re.compile(r"\b(\w+)=\{(%[^}]*)\}")


def _bits(dtype: str) -> int:
    """Bits per element: `pred` 8, `token` 0, else the width in the name (`bf16`, `f8e4m3fn`)."""
    if dtype == "pred":
        return 8
    width = re.search(r"\d+", dtype)
    return int(width.group()) if width else 0


def _dims(text: str) -> list[int]:
    return [int(d.lstrip("<=")) for d in text.split(",") if d]


def shape_bytes(shape: str, padded: bool = False) -> int:
    """Bytes of a shape's arrays (a tuple's summed): element count x dtype size, or with
    `padded` the bytes its layout's first tile `T(a,b)` pads it to (the minor-most dims in
    layout order rounded up to the tile; a rank below the tile's counts as leading 1s):
    `shape_bytes("bf16[2,64]{1,0:T(8,128)(2,1)}")` 256, padded 2048."""
    total = 0
    for dtype, dims_text, layout in _ARRAY.findall(shape):
        dims = _dims(dims_text)
        tile = _TILE.search(layout or "")
        if padded and tile:
            minor_to_major = [int(d) for d in layout[1:].split(":")[0].split(",") if d]
            dims = [dims[d] for d in reversed(minor_to_major)] if minor_to_major else dims
            sizes = [int(t) for t in tile.group(1).split(",")]
            dims = [1] * (len(sizes) - len(dims)) + dims
            lead, minor = dims[: len(dims) - len(sizes)], dims[len(dims) - len(sizes) :]
            dims = lead + [math.ceil(d / t) * t for d, t in zip(minor, sizes, strict=True)]
        total += math.ceil(math.prod(dims) * _bits(dtype) / 8)
    return total


def memory_space(shape: str) -> int:
    """The memory space `S(n)` of an array shape's layout (0, device memory, if none): on TPU
    1 is VMEM (on-chip scratch), 5 host memory."""
    found = _SPACE.search(shape)
    return int(found.group(1)) if found else 0


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "({["
        depth -= text[i] in ")}]"
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 80]!r}")


def split_tuple(shape: str) -> list[str]:
    """The elements of a tuple shape `(a, (b, c), d)` -> `["a", "(b, c)", "d"]`; an array
    shape is its own one element."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, begin = [], 0, 1
    for i, char in enumerate(shape[1:-1], start=1):
        depth += char in "({["
        depth -= char in ")}]"
        if char == "," and depth == 0:
            parts.append(shape[begin:i].strip())
            begin = i + 1
    parts.append(shape[begin:-1].strip())
    return [p for p in parts if p]


@dataclass(frozen=True)
class Instruction:
    """One instruction line: `%name = type opcode(operands), attrs`."""

    name: str
    type: str
    opcode: str
    args: str  # the text between the opcode's parentheses
    attrs: str
    root: bool = False

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(_NAME.findall(self.args))

    def calls(self) -> list[tuple[str, str]]:
        """`(attribute, computation)` of every computation it calls: `calls`, `to_apply`,
        `body`, `condition`, `branch_computations`, `called_computations`, ..."""
        one = [(key, name) for key, name in _ONE_CALL.findall(self.attrs)]
        many = [
            (key, name)
            for key, names in _MANY_CALLS.findall(self.attrs)
            for name in _NAME.findall(names)
        ]
        return one + many

    def element(self, index: int) -> str:
        """Element `index` of its tuple type (its type if an array)."""
        return split_tuple(self.type)[index]


def parse_instruction(line: str) -> Instruction | None:
    """The instruction on `line`, or None if it holds none."""
    found = _LINE.match(line)
    if not found:
        return None
    rest = found.group(3)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    opcode = _OPCODE.match(rest, end) if end > 0 else None
    if not opcode:
        return None
    close = _balanced(rest, opcode.end() - 1)
    args, attrs = rest[opcode.end() : close - 1], rest[close:]
    return Instruction(
        found.group(2), rest[:end], opcode.group(1), args, attrs, bool(found.group(1))
    )


@dataclass
class Computation:
    """A computation's instructions, in schedule order."""

    name: str
    entry: bool
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.root), self.instructions[-1])


@dataclass
class Module:
    """The parsed module: computations by name (text order) and every instruction by name."""

    computations: dict[str, Computation]
    entry: str
    instructions: dict[str, Instruction]

    def type_of(self, name: str) -> str:
        """The type of instruction `name` ("" if it is not in the module)."""
        found = self.instructions.get(name)
        return found.type if found else ""


def parse(hlo_text: str) -> Module:
    """The module of `compiled.as_text()` (or an HLO dump's text)."""
    computations: dict[str, Computation] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), bool(header.group(1)))
            computations[current.name] = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = parse_instruction(line)
            if instruction:
                current.instructions.append(instruction)
    entry = next((c.name for c in computations.values() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    every = {i.name: i for c in computations.values() for i in c.instructions}
    return Module(computations, entry, every)

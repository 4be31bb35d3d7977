"""How many times each computation of an optimized HLO module runs per execution: its loops'
trip counts, recorded by XLA or read from the loop's own instructions. Jax-free.

XLA:CPU and XLA:GPU record a while loop's trip count in its backend_config
(`"known_trip_count":{"n":"5"}`); XLA:TPU replaces the backend_config and records none, so
`trip_count` reads it from the loop: jax's scans and fori_loops count a tuple element up
from a constant to a constant bound.
"""

from __future__ import annotations

import re

from jaxpod.target.hlo_text import Instruction, Module

_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE"}


def _op(module: Module, name: str) -> Instruction | None:
    """The instruction computing `name`, seen through copies, bitcasts and converts, and
    through a fusion that wraps one instruction (XLA:CPU's `wrapped_compare`): that
    instruction with the fusion's operands in place of its parameters."""
    found = module.instructions.get(name)
    while found is not None and found.opcode in _PASS_THROUGH:
        found = module.instructions.get(found.operands[0])
    if found is None or found.opcode != "fusion":
        return found
    calls = dict(found.calls())
    inner = module.computations.get(calls.get("calls", ""))
    params = [module.instructions.get(n) for n in inner.root.operands] if inner else [None]
    if not all(p is not None and p.opcode == "parameter" for p in params):
        return found
    args = ", ".join(f"%{found.operands[int(p.args)]}" for p in params)
    root = inner.root
    return Instruction(root.name, root.type, root.opcode, args, root.attrs)


def _value(module: Module, name: str) -> tuple[str, int] | None:
    """A scalar loop value: `("constant", v)`, or `("element", k)`, element k of the
    computation's tuple parameter."""
    found = _op(module, name)
    if found is not None and found.opcode == "constant":
        return ("constant", int(found.args)) if re.fullmatch(r"-?\d+", found.args) else None
    if found is not None and found.opcode == "get-tuple-element":
        source = module.instructions.get(found.operands[0])
        index = re.search(r"index=(\d+)", found.attrs)
        if source is not None and source.opcode == "parameter" and index:
            return ("element", int(index.group(1)))
    return None


def trip_count(module: Module, loop: Instruction) -> int | None:
    """How many times a `while` runs its body: XLA's `known_trip_count`, else read from the
    loop: its condition compares a tuple element with a constant (`<`, `<=`, `>`, `>=`,
    `!=`), its initial tuple sets that element to a constant and its body adds a constant
    to it. None if the loop is not of that form."""
    known = _KNOWN_TRIPS.search(loop.attrs)
    if known:
        return int(known.group(1))
    calls = dict(loop.calls())
    cond = module.computations.get(calls.get("condition", ""))
    body = module.computations.get(calls.get("body", ""))
    compare = _op(module, cond.root.name) if cond else None
    direction = re.search(r"direction=(\w+)", compare.attrs) if compare else None
    init = module.instructions.get(loop.operands[0]) if loop.operands else None
    if not (direction and compare.opcode == "compare" and body and init):
        return None
    sides, op = [_value(module, n) for n in compare.operands], direction.group(1)
    if sides[0] and sides[0][0] == "constant":
        sides, op = sides[::-1], _FLIP.get(op, op)
    if not (sides[0] and sides[1] and sides[0][0] == "element" and sides[1][0] == "constant"):
        return None
    k = sides[0][1]
    if init.opcode != "tuple" or body.root.opcode != "tuple":
        return None
    start, step = _value(module, init.operands[k]), _step(module, body.root.operands[k], k)
    if not (start and start[0] == "constant" and step):
        return None
    return _count(start[1], sides[1][1], step, op)


def _step(module: Module, name: str, k: int) -> int | None:
    """The constant a loop body adds to tuple element `k` (None if it does not)."""
    found = _op(module, name)
    if found is None or found.opcode not in ("add", "subtract"):
        return None
    sides = [_value(module, n) for n in found.operands]
    sign = 1 if found.opcode == "add" else -1
    if sides[0] == ("element", k) and sides[1] and sides[1][0] == "constant":
        return sign * sides[1][1]
    if sign == 1 and sides[1] == ("element", k) and sides[0] and sides[0][0] == "constant":
        return sides[0][1]
    return None


def _count(start: int, bound: int, step: int, op: str) -> int | None:
    """Iterations of `for (i = start; i op bound; i += step)`."""
    if op in ("LT", "LE") and step > 0:
        return max(0, -(-(bound - start + (op == "LE")) // step))
    if op in ("GT", "GE") and step < 0:
        return max(0, -(-(start - bound + (op == "GE")) // -step))
    if op == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    return None


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    """The computations an instruction runs: none for the `-done`/`-update` halves of an
    async pair (its `-start` runs the wrapped computation)."""
    if instruction.opcode.endswith(("-done", "-update")):
        return []
    return instruction.calls()


def runs(module: Module) -> dict[str, int]:
    """How many times each computation reachable from the entry runs per execution of the
    module: a while's body its trip count times per run of the while (an unknown trip count,
    `trip_count` None, counts once), its condition once more; each branch of a conditional
    once per run of the conditional (an upper bound: one of them runs); the computation of a
    fusion, call or other instruction once per run of it; a computation called from several
    places, the sum. Keys in callers-first order."""
    order, seen = [], set()

    def visit(name: str) -> None:
        seen.add(name)
        for _, callee in (c for i in module.computations[name].instructions for c in _callees(i)):
            if callee not in seen and callee in module.computations:
                visit(callee)
        order.append(name)

    visit(module.entry)
    count = dict.fromkeys(reversed(order), 0)  # every caller before its callees
    count[module.entry] = 1
    for name in count:
        for instruction in module.computations[name].instructions:
            trips = trip_count(module, instruction) if instruction.opcode == "while" else None
            for key, callee in _callees(instruction):
                if callee in count:
                    factor = 1 if trips is None else trips + (key == "condition")
                    count[callee] += count[name] * factor
    return count

"""Which collectives of an optimized HLO module overlap compute, and with how much: the
evidence the step-time model's overlap credit must rest on. Jax-free.

A collective overlaps compute only when XLA made it asynchronous and scheduled work between
its start and its done; a plain `all-reduce(...)` (or a fusion holding one) blocks the chip
until it completes. The asynchronous forms read: `<kind>-start`/`<kind>-done` (the done's
operand is its start), `async-start`/`async-done` wrapping a collective, and libtpu's async
collective fusion (a fusion whose computation's root is `AsyncCollectiveStart`, continuation
fusions that compute while it runs, a fusion whose root is `AsyncCollectiveDone`), its start
and done linked by the data flowing from one to the other. A matmul is a `convolution` or
`dot`, or a fusion holding one (how XLA:TPU emits every matmul).
"""

from __future__ import annotations

from jaxpod.target.hlo import KINDS, shape_bytes
from jaxpod.target.hlo_runs import runs
from jaxpod.target.hlo_text import Instruction, Module, parse

__all__ = ["collective_overlap"]


def _inner(module: Module, instruction: Instruction) -> list[Instruction]:
    """The instructions of the computations it calls, through nested fusions."""
    found = []
    for _, name in instruction.calls():
        computation = module.computations.get(name)
        for inner in computation.instructions if computation else []:
            found.append(inner)
            if inner.opcode == "fusion":
                found.extend(_inner(module, inner))
    return found


def _root_target(module: Module, instruction: Instruction) -> str:
    """The custom-call target of a fusion's root ("" if none)."""
    computation = module.computations.get(dict(instruction.calls()).get("calls", ""))
    attrs = computation.root.attrs if computation else ""
    return next((t for t in ("AsyncCollectiveStart", "AsyncCollectiveDone") if t in attrs), "")


def _collective(module: Module, instruction: Instruction) -> tuple[str, bool] | None:
    """`(kind, asynchronous)` of the collective an instruction starts, or None (a done, a
    continuation, anything else)."""
    op = instruction.opcode
    if op.removesuffix("-start") in KINDS:
        return op.removesuffix("-start"), op.endswith("-start")
    if op not in ("fusion", "async-start") or "continuation_config" in instruction.attrs:
        return None
    target = _root_target(module, instruction) if op == "fusion" else ""
    if target == "AsyncCollectiveDone":
        return None
    inner = {i.opcode.removesuffix("-start") for i in _inner(module, instruction)}
    kind = next((k for k in KINDS if k in inner), None)
    started = op == "async-start" or target == "AsyncCollectiveStart"
    return (kind, started) if kind else None


def _is_done(module: Module, instruction: Instruction) -> bool:
    op = instruction.opcode
    if op.endswith("-done"):
        return True
    return op == "fusion" and _root_target(module, instruction) == "AsyncCollectiveDone"


def _is_matmul(module: Module, instruction: Instruction) -> bool:
    """A `convolution` or `dot`, or a fusion holding one."""
    if instruction.opcode in ("convolution", "dot"):
        return True
    inner = _inner(module, instruction) if instruction.opcode == "fusion" else []
    return any(i.opcode in ("convolution", "dot") for i in inner)


def _span(module: Module, order: list[Instruction], n: int) -> list[Instruction]:
    """The instructions after the start at `n` up to its done (the first done that the
    start's data reaches), or [] if no done follows in this computation."""
    reached = {order[n].name}
    for m, instruction in enumerate(order[n + 1 :], n + 1):
        if any(name in reached for name in instruction.operands):
            reached.add(instruction.name)
            if _is_done(module, instruction):
                return order[n + 1 : m]
    return []


def collective_overlap(hlo_text: str) -> list[dict]:
    """Each collective of the module in schedule order: `{"kind", "computation", "runs",
    "bytes", "asynchronous", "matmuls"}`, `runs` per step (`hlo_runs.runs`), `bytes` its
    operands' per chip, `matmuls` the matmuls scheduled between its start and its done (0
    for a synchronous one: the chip waits for it at once)."""
    module = parse(hlo_text)
    fused = {
        name
        for instruction in module.instructions.values()
        if instruction.opcode == "fusion"
        for _, name in instruction.calls()
    }
    found = []
    for name, times in runs(module).items():
        if name in fused:  # a fusion's body: its collective counts at the fusion
            continue
        order = module.computations[name].instructions
        for n, instruction in enumerate(order):
            collective = _collective(module, instruction)
            if collective is None:
                continue
            kind, started = collective
            span = _span(module, order, n) if started else []
            matmuls = sum(_is_matmul(module, i) for i in span)
            nbytes = sum(shape_bytes(module.type_of(o)) for o in instruction.operands)
            record = {"kind": kind, "computation": name, "runs": times, "bytes": nbytes}
            found.append({**record, "asynchronous": started, "matmuls": matmuls})
    return found

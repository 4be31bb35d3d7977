"""What an optimized HLO module does per chip: its collectives, its host<->device transfers,
and whether a transfer overlaps compute. Read from `compiled.as_text()` (parsed by
`hlo_text`); an SPMD module's shapes are one chip's, so every byte here is per chip, counted
with the logical shape (elements x dtype size, no tile padding). `count` is how many such
ops the module's text holds, `executed` how many run per step: each op weighted by the runs
of its computation (`hlo_runs.runs`: a loop body its trip count times, each branch of a
conditional once per run of the conditional).

Each collective counts once: an async pair (`collective-permute-start`/`-done`) at its
start, a tuple-typed op that XLA combined from several with its operands' bytes summed, an
async collective fusion (libtpu's `--xla_tpu_enable_async_collective_fusion`) at its start
fusion, not in the continuation and done fusions that repeat it, XLA:TPU's
all-reduce-scatter fusion as a reduce-scatter of its all-reduce's operand. A host transfer
is a copy between memory space `S(5)` and device memory; `S(1)` (VMEM) copies are on chip.
tests/target/test_hlo.py pins each form on lines XLA emits.
"""

from __future__ import annotations

from jaxpod.target.hlo_runs import runs
from jaxpod.target.hlo_text import (
    Computation,
    Instruction,
    Module,
    memory_space,
    parse,
    shape_bytes,
)

__all__ = ["KINDS", "async_overlap", "collectives", "shape_bytes", "transfers"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
HOST = 5  # the memory space `S(5)`: host memory on TPU; S(1), VMEM, is on chip
# instructions that compute (or communicate) between an async transfer's start and done
COMPUTE = {
    *KINDS,
    *(f"{kind}-start" for kind in KINDS),
    *("fusion", "convolution", "dot", "custom-call", "while", "conditional", "call"),
    *("reduce", "reduce-window", "scatter", "gather", "sort", "select-and-scatter"),
    "async-start",
}


def _tally() -> dict[str, int]:
    return {"count": 0, "bytes": 0, "executed": 0, "executed_bytes": 0}


def _add(tally: dict[str, int], nbytes: int, times: int) -> None:
    tally["count"] += 1
    tally["bytes"] += nbytes
    tally["executed"] += times
    tally["executed_bytes"] += nbytes * times


def _echoes(module: Module) -> set[str]:
    """Computations that repeat an async collective fusion's collective: its continuations'
    and its done's (the start's computation counts it)."""
    echoes = set()
    for computation in module.computations.values():
        for instruction in computation.instructions:
            if instruction.opcode == "fusion" and "continuation_config" in instruction.attrs:
                echoes.update(name for _, name in instruction.calls())
        if 'custom_call_target="AsyncCollectiveDone"' in computation.root.attrs:
            echoes.add(computation.name)
    return echoes


def _fused_reduce_scatter(computation: Computation) -> str | None:
    """The all-reduce of an "all-reduce-scatter" fusion's computation (its root
    dynamic-slices it, through bitcasts), or None."""
    instructions = {i.name: i for i in computation.instructions}
    node = computation.root
    while node.opcode == "bitcast" and node.operands and node.operands[0] in instructions:
        node = instructions[node.operands[0]]
    if node.opcode != "dynamic-slice" or not node.operands:
        return None
    source = instructions.get(node.operands[0])
    return source.name if source is not None and source.opcode == "all-reduce" else None


def _kind(instruction: Instruction) -> str | None:
    """The collective kind an instruction starts (None for a `-done` or no collective)."""
    opcode = instruction.opcode.removesuffix("-start")
    return opcode if opcode in KINDS else None


def _collective_bytes(module: Module, instruction: Instruction, dones: dict) -> int:
    """An all-gather's gathered result (an async one's done's), the others' operands."""
    if _kind(instruction) == "all-gather":
        done = dones.get(instruction.name)
        return shape_bytes(done.type if done is not None else instruction.type)
    return sum(shape_bytes(module.type_of(name)) for name in instruction.operands)


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """`{kind: {"count", "bytes", "executed", "executed_bytes"}}` for every kind in `KINDS`:
    the collectives of the module, an async pair or an async collective fusion once, an
    all-reduce-scatter fusion as a reduce-scatter (module docstring). Bytes per chip: an
    all-gather's gathered result, the other kinds' operands."""
    module = parse(hlo_text)
    totals = {kind: _tally() for kind in KINDS}
    echoes = _echoes(module)
    for name, times in runs(module).items():
        computation = module.computations[name]
        if name in echoes:
            continue
        dones = {i.operands[0]: i for i in computation.instructions if i.opcode.endswith("-done")}
        scatter = _fused_reduce_scatter(computation)
        for instruction in computation.instructions:
            kind = _kind(instruction)
            if kind is not None:
                kind = "reduce-scatter" if instruction.name == scatter else kind
                _add(totals[kind], _collective_bytes(module, instruction, dones), times)
    return totals


def _moves(module: Module, instruction: Instruction) -> list[tuple[int, int, int]]:
    """`(source space, destination space, bytes)` of the data an instruction moves between
    memory spaces (its operands' and its result's layouts): copies and async copies, slices
    read out of a buffer, updates written into one, and a host computation's reads of
    device memory and writes to it."""
    op, operands, of = instruction.opcode, instruction.operands, module.type_of
    if op in ("copy", "dynamic-slice", "slice") and operands:
        into = instruction.type
        return [(memory_space(of(operands[0])), memory_space(into), shape_bytes(into))]
    if op in ("copy-start", "dynamic-slice-start", "slice-start") and operands:
        into = instruction.element(1 if op != "copy-start" else 0)
        source = instruction.element(1) if op == "copy-start" else of(operands[0])
        return [(memory_space(source), memory_space(into), shape_bytes(into))]
    if op in ("dynamic-update-slice", "dynamic-update-slice-start") and len(operands) > 1:
        into = instruction.element(1) if op.endswith("-start") else instruction.type
        update = of(operands[1])
        return [(memory_space(update), memory_space(into), shape_bytes(update))]
    if op in ("custom-call", "custom-call-start") and _on_host(instruction):
        result = instruction.element(1) if op.endswith("-start") else instruction.type
        reads = [(memory_space(of(name)), HOST, shape_bytes(of(name))) for name in operands]
        return [*reads, (HOST, memory_space(result), shape_bytes(result))]
    return []


def _on_host(instruction: Instruction) -> bool:
    attrs = instruction.attrs
    return 'async_execution_thread="host"' in attrs or '"HostExecute"' in attrs


def _direction(source: int, destination: int) -> str | None:
    if source == HOST and destination != HOST:
        return "to_device"
    if destination == HOST and source != HOST:
        return "to_host"
    return None


def transfers(hlo_text: str) -> dict[str, dict[str, int]]:
    """`{"to_device": {"count", "bytes", "executed", "executed_bytes"}, "to_host": {...}}`:
    the data moved between host memory (`S(5)`) and any other memory space, per chip.

    Counted, by the layouts of what they read and write: `copy` and `copy-start` (the async
    copy: its result's element 0 is the destination, element 1 the source; the `-done` is
    not counted again); `dynamic-slice`/`slice` (and their `-start`) reading host memory,
    their result's bytes; `dynamic-update-slice` (and `-start`) writing into a host buffer,
    the update's bytes; a host computation (`custom-call-start ... async_execution_thread=
    "host"`, `HostExecute`): each operand not in host memory to the host, its result, if not
    in host memory, back. Not counted: copies between device memory and VMEM (`S(1)`, the
    on-chip scratch XLA prefetches into), arrays resting in host memory (`S(5)` parameters
    and results of the entry), and anything fusions read.

    What XLA:TPU emits for jaxpod's offloads (tiny preset, tpu-v5p): `memory.offload` of
    `params` and `optimizer` (pipelined, with or without `memory.phases`): async copies in
    the entry computation only, `(f32[2,64]{1,0:T(2,128)}, f32[2,64]{1,0:T(2,128)S(5)},
    u32[]{:S(2)}) copy-start(%param.39)` fetching each host-resident leaf and the reverse
    writing its new value back; no gradient crosses. Without a pipeline, the phases' slices
    are fetched in the micro-batch loop (`dynamic-slice-start` of an `S(5)` operand).
    `activations` under gpipe (the stage's layers looped): in the tick loop a
    `dynamic-update-slice-start` of each saved value into its `S(5)` buffer stacked over the
    ticks, read back by `dynamic-slice-start` in the backward ticks, no host computation;
    under remat `full` nothing (nothing saved)."""
    module = parse(hlo_text)
    totals = {"to_device": _tally(), "to_host": _tally()}
    for name, times in runs(module).items():
        for instruction in module.computations[name].instructions:
            for source, destination, nbytes in _moves(module, instruction):
                direction = _direction(source, destination)
                if direction:
                    _add(totals[direction], nbytes, times)
    return totals


def async_overlap(hlo_text: str, direction: str = "to_device") -> list[dict]:
    """Each async transfer in `direction` (`transfers`' kinds with a `-start`/`-done` pair), in
    schedule order: `{"name", "computation", "bytes", "between"}`, `between` the number of
    instructions that compute or communicate (`COMPUTE`; not AllocateBuffer custom-calls)
    scheduled after its start and before its done in their computation: 0, the transfer is
    waited for at once; more, it overlaps that work (a prefetch)."""
    module = parse(hlo_text)
    found = []
    for name in runs(module):
        order = module.computations[name].instructions
        done_at = {i.operands[0]: n for n, i in enumerate(order) if i.opcode.endswith("-done")}
        for n, instruction in enumerate(order):
            moves = _moves(module, instruction) if instruction.opcode.endswith("-start") else []
            move = [m for m in moves if _direction(m[0], m[1]) == direction]
            if move and instruction.name in done_at:
                span = order[n + 1 : done_at[instruction.name]]
                between = sum(_computes(i) for i in span)
                record = {"name": instruction.name, "computation": name}
                found.append({**record, "bytes": sum(m[2] for m in move), "between": between})
    return found


def _computes(instruction: Instruction) -> bool:
    if instruction.opcode == "custom-call":
        return 'custom_call_target="AllocateBuffer"' not in instruction.attrs
    return instruction.opcode in COMPUTE

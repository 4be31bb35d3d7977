"""Train steps compiled with XLA's dump (`xla_dump_to`) and read back: the temporaries and
their live ranges (`jaxpod.target.live_ranges`) and the memory spaces' totals, for the tests
that find a planner term's values at a compiled program's peak, on XLA:CPU or on a TPU
target (no TPU attached)."""

from __future__ import annotations

import glob
import tempfile
from pathlib import Path
from typing import NamedTuple


class Dumped(NamedTuple):
    """A train step compiled with XLA's dump, read back."""

    engine: object
    state: object  # the abstract TrainState, with its shardings
    compiled: object
    live: tuple  # (values, ranges, schedule): `jaxpod.target.live_ranges.temporaries`
    spaces: dict  # bytes per memory space (`jaxpod.target.buffers.memory_spaces`; {} on CPU)


def dumped_program(
    cfg, mesh, options: dict | None = None, updating: bool = True, device_only: bool = False
) -> Dumped:
    """`cfg`'s train step on `mesh`, lowered from abstract shapes (with the update's donated
    arguments if `updating`) and compiled with `options` and the dump, whose buffer
    assignment, live ranges (`device_only`: of the default memory space's temporaries) and
    memory spaces are read."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.buffers import DUMP_OPTIONS, memory_spaces, uncached
    from jaxpod.target.live_ranges import temporaries

    engine, state, batch = abstract_inputs(cfg, mesh)
    arguments = engine.updating_arguments(state, batch) if updating else (state, batch)
    lowered = engine.train_step.lower(*arguments)
    with tempfile.TemporaryDirectory(prefix="jaxpod-dump-") as dump:
        dumped = {**(options or {}), **DUMP_OPTIONS, "xla_dump_to": dump}
        with uncached():  # a program read from the cache is not compiled: nothing is dumped
            compiled = lowered.compile(compiler_options=dumped)
        reports = glob.glob(f"{dump}/*jit_train_step*memory-usage-report.txt")
        spaces = memory_spaces(Path(reports[0]).read_text()) if reports else {}
        live = temporaries(dump, device_only=device_only)
        return Dumped(engine, state, compiled, live, spaces)


def dumped_step(cfg, mesh, options: dict | None = None, updating: bool = True):
    """`(state, compiled, (values, ranges, schedule))` of `dumped_program`."""
    program = dumped_program(cfg, mesh, options, updating)
    return program.state, program.compiled, program.live


def tpu_mesh(shape: tuple[int, int, int], target: str):
    """The (replica, pipeline, tensor) mesh `shape` laid on the chips of `target` (e.g.
    "tpu-v5p:2x2x1"), as `jaxpod compile --target` lays it."""
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    return torus_mesh(shape, target_devices(parse_target(target)))


def tpu_probe(overrides: tuple, mesh: tuple[int, int, int], target: str) -> tuple:
    """`(cfg, state, module, (values, ranges, schedule))`: the tiny preset with `overrides` on
    `mesh`, its step compiled for `target` with the dump; `module` its parsed HLO."""
    from helpers import make_tiny_cfg
    from jaxpod.target.hlo_text import parse

    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    state, compiled, live = dumped_step(cfg, tpu_mesh(mesh, target))
    return cfg, state, parse(compiled.as_text()), live


def dims_of(shape: str) -> tuple[int, ...]:
    """The dimensions of an HLO array shape such as `f32[4,192,384]{2,1,0}`."""
    return tuple(int(d) for d in shape.split("[", 1)[1].split("]")[0].split(",") if d)


def peak_position(values: dict, ranges: dict) -> int:
    """The first position of the schedule at which the temporaries of `ranges` cover the
    most bytes (`jaxpod.target.live_ranges.covered`)."""
    from jaxpod.target.live_ranges import covered

    last = max(b for _, b in ranges.values())
    return max(range(last + 1), key=lambda t: covered(values, ranges, t))


def layer_ranges(cfg, values: dict, ranges: dict, schedule: dict) -> dict:
    """The live ranges of one layer's values: temporaries of the micro-batch's shape ([b, ...]
    or [1, b, ...], rank 3 or more) alive for under an eighth of the schedule (not the saved
    stack or the carries)."""
    b, steps = cfg.train.micro_batch, max(schedule) + 1

    def layer_value(name: str) -> bool:
        dims = dims_of(values[name][2])
        batch = dims[:1] == (b,) or dims[:2] == (1, b)
        first, last = ranges[name]
        return len(dims) >= 3 and batch and last - first < steps // 8

    assert cfg.model.layers != b  # the saved stack [L, b, T, D] is not a layer's value
    return {name: r for name, r in ranges.items() if layer_value(name)}


def planned_over_xla(cfg, compiled, profile) -> float:
    """The planner's device total for `profile` over XLA's (arguments + temporaries) of
    `compiled`."""
    from jaxpod.planner.activations import activation_bytes
    from jaxpod.planner.bytes import device_bytes
    from jaxpod.planner.counts import param_layout

    planned = device_bytes(cfg, param_layout(cfg), activation_bytes(cfg, profile), profile)
    memory = compiled.memory_analysis()
    return planned["device_total"] / (memory.argument_size_in_bytes + memory.temp_size_in_bytes)


def switch_saved(cfg, mesh: tuple[int, int, int], target: str) -> tuple[list[str], int]:
    """`(element types of the largest `conditional`'s result, XLA's HBM total)` of `cfg`'s
    step compiled for `target` on `mesh`: the values a pipelined step's stage `lax.switch`
    saves for its backward."""
    from jaxpod.target.buffers import device_memory_bytes
    from jaxpod.target.hlo_text import parse, split_tuple

    dumped = dumped_program(cfg, tpu_mesh(mesh, target), device_only=True)
    module = parse(dumped.compiled.as_text())
    conds = [i for i in module.instructions.values() if i.opcode == "conditional"]
    saved = max((split_tuple(i.type) for i in conds), key=len)
    return saved, device_memory_bytes(dumped.spaces)

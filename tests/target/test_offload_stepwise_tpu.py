"""`memory.offload=[activations]` under the stepwise schedules (1f1b, zb-h1, interleaved-1f1b,
zb-v), found in XLA:TPU's compiled program (libtpu, no TPU attached): the tiny preset at d 256,
256 positions, 4 sequences a micro-batch on a TPU v5p 2x2x2 slice, the planner's credit
(`jaxpod.planner.host_saved`) against the program's host memory and transfers.

A backward tick recomputes its stage and runs its vjp inside the tick: each layer's saved
values go to host memory and come back within the tick, the host holding the values of the
tick's L / (S V) layers, in one buffer per value (stacked over the layers where a tick runs
more than one). The planner's host activations are those bytes; its device total is what it
is without the offload.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import pytest
from helpers import make_tiny_cfg

from jaxpod.parallel.schedules import make_schedule
from jaxpod.target.buffers import compile_with_spaces, device_memory_bytes
from jaxpod.target.hlo import transfers
from jaxpod.target.hlo_text import shape_bytes

pytestmark = pytest.mark.slow

TARGET = "tpu-v5p:2x2x2"
MESH = (2, 2, 2)
ACTIVE = ("model.d_model=256", "model.heads=2", "model.d_ff=1024", "model.seq_len=256")
ACTIVE += ("train.micro_batch=4",)
OFFLOAD = "memory.offload=[activations]"
SCHEDULES = {
    "1f1b": ("train.pipeline_schedule=1f1b",),
    "zb-h1": ("train.pipeline_schedule=zb-h1",),
    "interleaved-1f1b": ("train.pipeline_schedule=interleaved-1f1b", "train.virtual_stages=2"),
    "zb-v": ("train.pipeline_schedule=zb-v", "train.virtual_stages=2"),
}


class Program(NamedTuple):
    cfg: object
    text: str  # the optimized HLO
    memory: object  # `memory_analysis()`
    spaces: dict  # bytes per memory space (`jaxpod.target.buffers`)


@pytest.fixture(scope="module")
def tpu():
    """`tpu(*overrides) -> Program` on the 2x2x2 mesh, each compiled once per module."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    devices = target_devices(parse_target(TARGET))
    done: dict = {}

    def compile_(*overrides: str) -> Program:
        if overrides not in done:
            cfg = make_tiny_cfg(*ACTIVE, *overrides, mesh=MESH)
            engine, state, batch = abstract_inputs(cfg, torus_mesh(MESH, devices))
            lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
            compiled, spaces = compile_with_spaces(lowered, {})
            text = compiled.as_text()
            done[overrides] = Program(cfg, text, compiled.memory_analysis(), spaces)
        return done[overrides]

    return compile_


def planned(cfg) -> dict:
    """The plan of `cfg` for the target's device profile."""
    from jaxpod.planner.plan import plan
    from jaxpod.target.spec import parse_target

    profile = parse_target(TARGET).profile
    return plan(dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device=profile)))


def host_arrays(text: str) -> set[str]:
    """The array shapes (layout dropped) that the program places in host memory (`S(5)`)."""
    return set(re.findall(r"(\w+\[[\d,]*\])\{[^}]*S\(5\)\}", text))


@pytest.mark.parametrize(
    ("schedule", "remat"),
    [(kind, remat) for remat in ("comms", "minimal") for kind in SCHEDULES],
)
def test_a_backward_tick_offloads_its_own(tpu, schedule, remat):
    """The arrays in host memory are one per saved value, over the tick's layers (`[L/(S V),
    ...]`, or the layer's own shape where a tick runs one layer), together the planner's host
    activations to the byte, and so is XLA:TPU's host memory space (`cmem`). Each way one
    transfer per value and layer, of those bytes in all, in a computation that runs once per
    tick (a branch of the tick's switch). Remat comms, and minimal over one layer a tick:
    XLA:TPU's host temporaries (`memory_analysis`) are those bytes too (minimal over two
    layers: 14.7 MB, though its host memory space holds 9.4)."""
    overrides = (*SCHEDULES[schedule], f"model.remat={remat}")
    program = tpu(*overrides, OFFLOAD)
    kept = tpu(*overrides)
    cfg = program.cfg
    per_tick = cfg.model.layers // (cfg.mesh.pipeline * cfg.train.virtual_stages)
    plan = planned(cfg)
    host = plan["activations_breakdown"]["host"]
    assert host > 0 and host % per_tick == 0
    stacked = host_arrays(program.text)
    assert sum(shape_bytes(shape) for shape in stacked) == host
    if per_tick > 1:
        assert {int(shape.split("[")[1].split(",")[0]) for shape in stacked} == {per_tick}
    assert program.spaces["cmem"] == host
    assert program.memory.host_temp_size_in_bytes >= host
    if remat == "comms" or per_tick == 1:
        assert program.memory.host_temp_size_in_bytes == host
    tr, stages = cfg.train, cfg.mesh.pipeline
    ticks = make_schedule(tr.pipeline_schedule, stages, cfg.part_micro, tr.virtual_stages).ticks
    moved, count = transfers(program.text), len(stacked) * per_tick
    for way in ("to_host", "to_device"):
        assert (moved[way]["count"], moved[way]["bytes"]) == (count, host)
        assert moved[way]["executed"] == count * ticks
    device_total = planned(kept.cfg)["bytes_per_device"]["device_total"]
    assert plan["bytes_per_device"]["device_total"] == device_total
    xla = device_memory_bytes(program.spaces) - device_memory_bytes(kept.spaces)
    print(schedule, remat, f"host {host} XLA:TPU HBM {xla:+d}")

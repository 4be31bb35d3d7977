"""`compile_to_inspect` reads the program a run compiles: the optimized HLO, its buffer
assignment and its cost are those of the default compile; only LLVM's machine code differs.

The memory and HLO tests (tests/planner/, `jaxpod compile`) compile this way. Checked on the
float16 GPT step on 2x2x2 (stochastic rounding in per-layer loops, a pipeline, tensor
parallelism: test_pinned's program, whose default compile the session's compilation cache
serves) and the tiny EfficientNet's step on 4x2x1 (packed stages: test_pinned's effnet-421
program).
"""

from __future__ import annotations

import re

import pytest
from helpers import FP16_LARS, GPT16, TINY_VISION, grouped_cases

pytestmark = pytest.mark.engine  # compiles whole train steps: `make test` only

CASES = {  # name -> (overrides, mesh): test_pinned's gpt-fp16-222 and effnet-421
    "gpt-fp16": ((*GPT16, *FP16_LARS), (2, 2, 2)),
    "effnet": (TINY_VISION, (4, 2, 1)),
}


def _program(hlo: str) -> str:
    """Optimized HLO without source locations (a cached executable carries those of the
    trace that compiled it: the compilation cache's key leaves them out)."""
    head, _, rest = hlo.partition("\n\n")
    body = rest[rest.index("\n%") :] if rest.startswith("FileNames") else rest
    return head + re.sub(r", metadata=\{[^{}]*\}", "", body)


def _read(compiled) -> dict:
    mem = compiled.memory_analysis()
    sizes = {f: getattr(mem, f"{f}_size_in_bytes") for f in ("argument", "output", "temp", "alias")}
    return {
        "hlo": _program(compiled.as_text()),
        "memory": sizes,
        "cost": compiled.cost_analysis(),
        "executable": compiled.runtime_executable().serialize(),  # its machine code
    }


@pytest.mark.parametrize("name", grouped_cases(CASES))
def test_the_inspected_program_is_the_default_compile(name, tiny_cfg, mesh_for):
    from jaxpod.inspect.compile import INSPECT_OPTIONS, abstract_inputs, compile_to_inspect

    overrides, mesh = CASES[name]
    cfg = tiny_cfg(*overrides, mesh=mesh)
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    lowered = engine.train_step.lower(state, batch)
    default, inspected = _read(lowered.compile()), _read(compile_to_inspect(lowered))
    assert inspected["memory"] == default["memory"]
    assert inspected["cost"] == default["cost"]
    assert inspected["hlo"] == default["hlo"]
    # ... of another executable: the options took effect on the machine code
    assert INSPECT_OPTIONS == {"xla_backend_optimization_level": 0}
    assert inspected["executable"] != default["executable"]

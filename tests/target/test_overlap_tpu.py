"""Which of jaxpod's collectives XLA:TPU overlaps with compute, found in its compiled GPT steps
(libtpu with its default flags, no TPU attached; a v5e 2x4 slice, tensor 4 over 2 replicas):

- tensor parallelism without sequence parallelism: every all-reduce of the layers' partial
  sums is a plain `all-reduce`, the chip waits for it at once; so is the data-parallel
  gradient reduction after the layers;
- with sequence parallelism: the layers' reduce-scatters are waited for at once, while
  some all-gathers are libtpu's async collective fusions with matmuls computing between
  their start and done.

The step-time model's TPU profiles credit no overlap of tensor or data-parallel collectives
(`jaxpod.planner.speed.Speed`), which the first property is the evidence for.
"""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

from jaxpod.target.overlap import collective_overlap

pytestmark = pytest.mark.slow

TARGET = "tpu-v5e:2x4"
MESH = (2, 1, 4)  # replica, pipeline, tensor
SHAPE = ("model.d_model=1024", "model.heads=8", "model.d_ff=4096", "model.layers=2")
SHAPE += ("model.seq_len=512", "train.grad_accum=1")


@pytest.fixture(scope="module")
def compiled():
    """`compiled(*overrides) -> (cfg, [collective])`, each probe compiled once."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    devices = target_devices(parse_target(TARGET))
    done: dict = {}

    def compile_(*overrides: str):
        if overrides not in done:
            cfg = make_tiny_cfg(*SHAPE, *overrides, mesh=MESH)
            engine, state, batch = abstract_inputs(cfg, torus_mesh(MESH, devices))
            lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
            done[overrides] = cfg, collective_overlap(lowered.compile().as_text())
        return done[overrides]

    return compile_


def _activation_bytes(cfg, dtype_bytes: int) -> int:
    """One micro-batch's [b, T, D] rows on a chip."""
    return cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model * dtype_bytes


def test_tensor_all_reduces_are_waited_for_at_once(compiled):
    cfg, found = compiled("model.sequence_parallel=false")
    rows = {_activation_bytes(cfg, 2), _activation_bytes(cfg, 4)}
    tensor = [c for c in found if c["kind"] == "all-reduce" and c["bytes"] in rows]
    in_loops = [c for c in tensor if c["runs"] == cfg.model.layers]
    assert len(in_loops) >= 4  # per layer two forward, two backward
    assert not any(c["asynchronous"] for c in found)
    assert not any(c["matmuls"] for c in found)


def test_sequence_parallel_gathers_overlap_matmuls_scatters_do_not(compiled):
    cfg, found = compiled("model.sequence_parallel=true")
    gathers = [c for c in found if c["kind"] == "all-gather"]
    scatters = [c for c in found if c["kind"] == "reduce-scatter"]
    assert scatters and not any(c["asynchronous"] for c in scatters)
    overlapped = [c for c in gathers if c["asynchronous"] and c["matmuls"]]
    assert overlapped and any(c["runs"] == cfg.model.layers for c in overlapped)
    assert not any(c["asynchronous"] for c in found if c["kind"] == "all-reduce")

"""The circular schedule in XLA:TPU's compiled steps (libtpu, no TPU attached; GPT, 8 layers on
a 2x2x1 mesh of a v5p 2x2x1 slice, 2 virtual stages: two layers a tick; float32 and bfloat16
compute), against the planner's tick-scan terms (`jaxpod.planner.activations`,
`_tick_scan_buffers`), read on XLA:CPU and held by XLA:TPU at its peak, the backward ticks:

- the forward tick scan's saved residuals, [ticks, layers a tick, b, T, D] in the compute
  dtype: the planner's `saved`;
- the cotangent of the ticks' collected outputs, `ticks` rows, and of the embedded
  micro-batches, `micro` rows;
- two float32 gradients of each of the stage's stacked matrices: the stage's accumulator
  and the tick's layer scan's (`tick_grads`), which the planner counts beside it.
"""

from __future__ import annotations

import math

import jax
import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, tpu_mesh

from jaxpod.planner.activations import DTYPE_BYTES, activation_bytes, stored_bytes
from jaxpod.planner.counts import layer_params
from jaxpod.planner.profiles import get_profile
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.slow

TARGET, PROFILE, MESH = "tpu-v5p:2x2x1", get_profile("tpu-v5p"), (2, 2, 1)
CIRCULAR = ("train.pipeline_schedule=circular", "train.virtual_stages=2", "model.layers=8")
CIRCULAR += ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
CIRCULAR += ("model.vocab=8192", "train.micro_batch=1", "train.grad_accum=4")
CIRCULAR += ("model.remat=full", "memory.device=tpu-v5p")
PROBES = {"float32": CIRCULAR, "bfloat16": (*CIRCULAR, "precision.compute=bfloat16")}


@pytest.fixture(scope="module", params=sorted(PROBES))
def probe(request):
    """`(cfg, state, (values, ranges, schedule))` of one probe's compiled step."""
    cfg = make_tiny_cfg(*PROBES[request.param], mesh=MESH)
    state, _, live = dumped_step(cfg, tpu_mesh(MESH, TARGET))
    return cfg, state, live


def _at_peak(values: dict, ranges: dict, schedule: dict) -> list[tuple[str, tuple, str]]:
    """`(name, dims, shape)` of the temporaries alive where they cover the most bytes."""
    _, peak = max((covered(values, ranges, t), t) for t in range(max(schedule) + 1))
    alive = [v for v, (a, b) in ranges.items() if a <= peak <= b]
    return [(v, dims_of(values[v][2]), values[v][2]) for v in alive]


def test_the_backward_ticks_hold_the_tick_scans_buffers(probe):
    """At the peak the saved residuals of every tick are one [ticks, layers a tick, b, T, D]
    value of the planner's `saved` bytes, and the ticks' and the micro-batches' cotangents
    are `ticks` and `micro` rows [b, T, D] in the stored dtype."""
    cfg, _, (values, ranges, schedule) = probe
    md, mesh = cfg.model, cfg.mesh
    b, s, d = cfg.train.micro_batch, md.seq_len, md.d_model
    micro, virtual = cfg.pipeline_group, cfg.train.virtual_stages
    ticks, per_tick = virtual * micro + mesh.pipeline - 1, md.layers // mesh.pipeline // virtual
    alive = _at_peak(values, ranges, schedule)
    acts, sb = activation_bytes(cfg, PROFILE), stored_bytes(cfg, PROFILE)
    saved = [v for v, dims, _ in alive if dims == (ticks, per_tick, b, s, d)]
    assert [values[v][0] for v in saved] == [acts["saved"]], alive
    for rows in (ticks, micro):
        found = [
            v for v, dims, _ in alive if dims[:1] == (rows,) and math.prod(dims) == rows * b * s * d
        ]
        assert [values[v][0] for v in found] == [rows * b * s * d * sb], (rows, alive)


def test_the_stage_matrices_have_two_float32_gradients(probe):
    """At the peak each of the stage's stacked matrices has two float32 gradients of its
    shard's shape, the accumulator and the tick's layer scan's: the planner's `tick_grads`
    is one stage's layer gradients, beside those the backward peak counts."""
    cfg, state, (values, ranges, schedule) = probe
    widths = (cfg.model.d_model, cfg.model.d_ff)
    stack = jax.tree.leaves(state.params["layers"])
    matrices = [x for x in stack if x.ndim >= 3 and x.shape[1] in widths]
    shards = [tuple(x.sharding.shard_shape(x.shape)) for x in matrices]
    assert len(shards) == len(set(shards)) == 4
    alive = _at_peak(values, ranges, schedule)
    for shard in shards:
        f32 = [v for v, dims, shape in alive if dims == shard and shape.startswith("f32[")]
        assert len(f32) == 2, (shard, f32)
    sharded, replicated = layer_params(cfg.model)
    per_stage = cfg.model.layers // cfg.mesh.pipeline
    layer = (sharded // cfg.mesh.tensor + replicated) * DTYPE_BYTES[cfg.precision.params]
    tick_grads = activation_bytes(cfg, PROFILE)["tick_grads"]
    assert tick_grads == per_stage * layer
    assert sum(4 * math.prod(shard) for shard in shards) <= tick_grads

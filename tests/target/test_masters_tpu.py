"""`casts_in_layer_loops` found in XLA:TPU's compiled steps (libtpu, no TPU attached; the base
GPT at d 512 with bfloat16 weights cast from float32 masters, bfloat16 compute, remat full,
on a v5p 2x2x1 slice, without a pipeline and under GPipe): the step casts the masters a layer
at a time, so no whole bfloat16 copy of a stacked matrix is stored, and the stack's
gradients are float32 (autodiff's gradients of the masters), the planner's `grad_bytes`.
"""

from __future__ import annotations

import jax
import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, tpu_mesh

from jaxpod.planner.activations import grad_bytes
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x1", get_profile("tpu-v5p")
MASTERS = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
MASTERS += ("model.vocab=8192", "model.remat=full", "precision.compute=bfloat16")
MASTERS += ("precision.params=bfloat16", "precision.master=float32")
PROBES = {
    "no-pipeline": ((*MASTERS, "train.grad_accum=2"), (4, 1, 1)),
    "gpipe": ((*MASTERS, "train.grad_accum=4", "model.layers=8"), (1, 4, 1)),
}


@pytest.fixture(scope="module", params=sorted(PROBES))
def probe(request):
    """`(cfg, stack shapes, values at the peak as (dtype, dims))` of one probe's step."""
    overrides, mesh = PROBES[request.param]
    cfg = make_tiny_cfg(*overrides, f"train.pipeline_schedule={'gpipe'}", mesh=mesh)
    state, _, (values, ranges, _) = dumped_step(cfg, tpu_mesh(mesh, TARGET))
    peak = peak_position(values, ranges)
    alive = [values[v][2] for v, (a, b) in ranges.items() if a <= peak <= b]
    stack = [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(state.params["layers"])]
    matrices = [tuple(s) for s in stack if len(s) >= 3]
    return cfg, matrices, [(shape.split("[")[0], dims_of(shape)) for shape in alive]


def test_the_stack_gradients_are_float32(probe):
    """At the peak each stacked matrix of the stage has a float32 gradient of its shard's
    shape and none in bfloat16; the planner counts the gradients at 4 bytes a scalar."""
    cfg, matrices, alive = probe
    assert grad_bytes(cfg, PROFILE) == 4
    for shape in matrices:
        assert ("f32", shape) in alive, (shape, alive)
        assert ("bf16", shape) not in alive, shape


def test_no_whole_bfloat16_stack_is_stored(probe):
    """No bfloat16 value of a stacked matrix's whole shape is alive at the peak: the masters
    are cast inside the layer loops, one layer at a time."""
    _, matrices, alive = probe
    assert not [dims for dtype, dims in alive if dtype == "bf16" and dims in matrices]

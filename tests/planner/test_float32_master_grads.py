"""XLA:CPU casts a float32 master stack to float16 one layer at a time inside the layer loops:
at the compiled step's peak the values with the shapes of the stage's stacked matrices
(W_qkv, W_o, W_in, W_out: the device's shards, every layer of the stage) are exactly two
float32 copies of the stack, the gradient accumulator and the layer loop's gradient, and no
float16 copy; the planner counts float32 gradients and no working copy
(`DeviceProfile.casts_in_layer_loops`), and with them each probe's plan is within 10 % of
XLA's device total (the `cpu` profile)."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, planned_over_xla

from jaxpod.planner.activations import grad_bytes
from jaxpod.planner.bytes import _state_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.engine

F16 = ("precision.params=float16", "precision.compute=float16", "precision.master=float32")
F16 += ("precision.loss_scale=dynamic", "model.seq_len=32", "model.d_model=192")
F16 += ("model.d_ff=768", "model.heads=2")
PROBES = {  # (overrides, mesh)
    "gpt-adamw-2x1x2": ((*F16, "optim.name=adamw"), (2, 1, 2)),
    "bert-lamb-gpipe-2x2x1": (
        (*F16, "model.name=bert", "model.vocab=264", "optim.name=lamb"),
        (2, 2, 1),
    ),
    "gpt-adamw-1f1b-1x2x2": ((*F16, "optim.name=adamw", "train.pipeline_schedule=1f1b"), (1, 2, 2)),
}


def _stack_shapes(cfg) -> set[tuple[int, ...]]:
    """The dims of the stage's stacked matrices as the device holds them (no RTS):
    `[L/p, ...]`, tensor-sharded."""
    md, t = cfg.model, cfg.mesh.tensor
    layers, d, f, h = md.layers // cfg.mesh.pipeline, md.d_model, md.d_ff, md.heads
    return {
        (layers, d, 3, d // t),  # W_qkv [D, 3, D/t]
        (layers, d // t, d),  # W_o [D/t, D]
        (layers, d, f // t),  # W_in
        (layers, f // t, d),  # W_out
        (layers, d, 3, h // t, d // h),  # W_qkv per head, where the model keeps it so
    }


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_float32_master_stack_has_float32_grads(name, mesh_for):
    from jaxpod.inspect.compile import inspect_options

    overrides, mesh = PROBES[name]
    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    _, compiled, (values, ranges, _) = dumped_step(
        cfg, mesh_for(cfg), inspect_options(), updating=False
    )
    shapes = _stack_shapes(cfg)
    peak = peak_position(values, ranges)
    alive = {
        v: (size, shape[:3])
        for v, (size, _, shape) in values.items()
        if shape[:3] in ("f32", "f16")
        and dims_of(shape) in shapes
        and v in ranges
        and ranges[v][0] <= peak <= ranges[v][1]
    }
    md = cfg.model  # elements of the stage's four stacked matrices, one device's shards
    stack = md.layers // cfg.mesh.pipeline * md.d_model * (4 * md.d_model + 2 * md.d_ff)
    stack //= cfg.mesh.tensor
    held = {dtype: sum(n for n, dt in alive.values() if dt == dtype) for dtype in ("f32", "f16")}
    profile = get_profile("cpu")
    assert grad_bytes(cfg, profile) == 4
    assert held == {"f32": 2 * stack * 4, "f16": 0}, (name, peak, alive, stack)
    layout = param_layout(cfg)
    s = _state_bytes(cfg, layout, profile)
    assert s["weights"] == s["master"] and s["grads_update"] == layout["local"] * 4
    assert planned_over_xla(cfg, compiled, profile) == pytest.approx(1.0, abs=0.10), name

"""XLA:CPU converts a bfloat16 layer stack to float32 whole: the compiled step's float32
temporaries with the shapes of the stage's stacked matrices (W_qkv, W_o, W_in, W_out: the
device's shards, every layer of the stage, RTS's shard included) are exactly the planner's
`_widened_matrices`, alive at the step's peak, and with them the plan is within 10 % of
XLA's device total (the `cpu` profile: `DeviceProfile.stores_in_float32`)."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, planned_over_xla

from jaxpod.planner.bytes import _widened_matrices
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.engine

BF16 = ("precision.params=bfloat16", "precision.compute=bfloat16")
BF16 += ("precision.master=same-as-params", "model.seq_len=32", "model.d_model=192")
BF16 += ("model.d_ff=768", "model.heads=2")
PROBES = {  # (overrides, mesh)
    "gpt-2x1x2": ((*BF16, "optim.name=lars"), (2, 1, 2)),
    "bert-rts2-2x1x2": (
        (*BF16, "model.name=bert", "model.vocab=264", "optim.name=lars", "memory.rts=2"),
        (2, 1, 2),
    ),
    "gpt-gpipe-2x2x2": ((*BF16, "optim.name=lars"), (2, 2, 2)),
}


def _stack_shapes(cfg) -> set[tuple[int, ...]]:
    """The dims of the stage's stacked matrices as the device holds them: `[L/p, ...]`,
    tensor-sharded, RTS splitting the dimension the placement picks (W_o: its unsharded
    one; `jaxpod.engine.placement`)."""
    md, t, rts = cfg.model, cfg.mesh.tensor, cfg.memory.rts
    layers, d, f, h = md.layers // cfg.mesh.pipeline, md.d_model, md.d_ff, md.heads
    return {
        (layers, d // rts, 3, d // t),  # W_qkv [D, 3, D/t]
        (layers, d // t, d // rts),  # W_o [D/t, D]
        (layers, d // rts, f // t),  # W_in
        (layers, f // t // rts, d),  # W_out
        (layers, d // rts, 3, h // t, d // h),  # W_qkv per head, where the model keeps it so
    }


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_bfloat16_stack_is_held_in_float32(name, mesh_for):
    from jaxpod.inspect.compile import inspect_options

    overrides, mesh = PROBES[name]
    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    _, compiled, (values, ranges, _) = dumped_step(
        cfg, mesh_for(cfg), inspect_options(), updating=False
    )
    shapes = _stack_shapes(cfg)
    wide = {
        v: size
        for v, (size, _, shape) in values.items()
        if shape.startswith("f32[") and dims_of(shape) in shapes and v in ranges
    }
    profile = get_profile("cpu")
    term = _widened_matrices(cfg, profile)
    # at the step's peak: one float32 copy of each matrix, nothing else of their shapes
    peak = peak_position(values, ranges)
    alive = {v: n for v, n in wide.items() if ranges[v][0] <= peak <= ranges[v][1]}
    assert term > 0 and sum(alive.values()) == term, (name, peak, alive, term)
    assert planned_over_xla(cfg, compiled, profile) == pytest.approx(1.0, abs=0.10), name

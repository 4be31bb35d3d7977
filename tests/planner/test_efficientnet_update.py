"""The packed EfficientNet update's values in XLA:CPU's compiled step, against the planner's
`update_work` (`jaxpod.planner.efficientnet`): the digits preset (4x2x1) with LAMB, whose
two 16-bit moments are one row of `2 n_max`, rounded in one go; its peak is that rounding.
With float32 masters and AdamW or LAMB nothing is rounded: the peak joins the new moments."""

from __future__ import annotations

import math

import pytest
from helpers import digits_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, planned_over_xla

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.counts import efficientnet_stage_params
from jaxpod.planner.efficientnet import MOMENT_ROUNDING_WORDS, NEW_WEIGHTS_ROWS
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.engine  # compiles a whole train step: `make test` only

CPU = get_profile("cpu")


def _alive(values: dict, ranges: dict, t: int) -> dict:
    """`{name: (dtype, dims, size, (first, last))}` of the temporaries alive at `t`."""
    return {
        v: (shape[:3], dims_of(shape), size, ranges[v])
        for v, (size, _, shape) in values.items()
        if v in ranges and ranges[v][0] <= t <= ranges[v][1]
    }


def test_lamb_16_bit_moments_round_as_one_row(mesh_for):
    """At the peak XLA:CPU holds the moments' row of `2 n` as two uint32 lanes, in float32
    and rounded to float16, the unscaled float32 gradient row of `n`, and new float32 moment
    leaves read after the rounding (alive from before the row's concatenate to after the
    rounded row is made); the planner counts that moment, and its plan is within 10 %."""
    from jaxpod.inspect.compile import inspect_options

    cfg = digits_cfg("optim.name=lamb")
    n = max(efficientnet_stage_params(cfg))
    _, compiled, (values, ranges, _) = dumped_step(cfg, mesh_for(cfg), inspect_options())
    alive = _alive(values, ranges, peak_position(values, ranges))
    rows = sorted(dt for dt, dims, _, _ in alive.values() if dims == (2 * n,))
    assert rows == ["f16", "f32", "u32", "u32"], alive
    assert [dt for dt, dims, _, _ in alive.values() if dims == (n,)] == ["f32"], alive
    (row,) = [r for dt, dims, _, r in alive.values() if (dt, dims) == ("f32", (2 * n,))]
    (rounded,) = [r for dt, dims, _, r in alive.values() if (dt, dims) == ("f16", (2 * n,))]
    leaves = sum(
        size
        for dt, dims, size, (first, last) in alive.values()
        if dt == "f32" and len(dims) == 1 and dims[0] < n and first < row[0] and last > rounded[0]
    )
    assert 0 < leaves <= 2 * n * 4
    work = activation_bytes(cfg, CPU)["update_work"]
    assert work == 2 * n * (MOMENT_ROUNDING_WORDS * 4 + 2) + n * 4
    ratio = planned_over_xla(cfg, compiled, CPU)
    print(f"planned / XLA {ratio:.3f}")
    assert ratio == pytest.approx(1.0, abs=0.10)


def test_float32_master_rows_store_no_16_bit_row(mesh_for):
    """With float32 masters (LARS) the stage casts its leaves to float16 inside each tick:
    XLA:CPU stores no 16-bit value of a row's size (no working copy), and the gradients
    accumulate in a float32 row through the tick loops. Its peak is a micro-batch's gradient
    row concatenated beside that accumulator. The planner counts float32 gradients, no
    working copy, that concatenate's two rows and an update of two float32 rows (LARS's new
    momentum is its update), and its plan is within 10 %."""
    from jaxpod.inspect.compile import inspect_options
    from jaxpod.planner.bytes import _state_bytes
    from jaxpod.planner.counts import param_layout

    cfg = digits_cfg("precision.master=float32")
    n = max(efficientnet_stage_params(cfg))
    _, compiled, (values, ranges, schedule) = dumped_step(cfg, mesh_for(cfg), inspect_options())
    steps = max(schedule) + 1
    shapes = {v: (shape[:3], dims_of(shape)) for v, (_, _, shape) in values.items()}
    assert not [v for v, (dt, dims) in shapes.items() if dt == "f16" and math.prod(dims) >= n // 2]
    carried = [
        v for v, (a, b) in ranges.items() if shapes[v] == ("f32", (n,)) and b - a > steps // 3
    ]
    assert carried, "no float32 gradient row carried through the ticks"
    peak = peak_position(values, ranges)
    alive = _alive(values, ranges, peak)
    assert values[schedule[peak]][2].startswith(f"f32[{n}]"), schedule[peak]
    assert schedule[peak].startswith("concatenate")
    rows = sum(1 for dt, dims, _, _ in alive.values() if (dt, dims) == ("f32", (n,)))
    assert rows == 2, alive  # the accumulator and the concatenated row
    acts = activation_bytes(cfg, CPU)
    assert acts["update_work"] == 2 * n * 4 and acts["layer_work"] == 2 * n * 4
    s = _state_bytes(cfg, param_layout(cfg), CPU)
    assert s["weights"] == s["master"] and s["grads_update"] == n * 4
    ratio = planned_over_xla(cfg, compiled, CPU)
    print(f"planned / XLA {ratio:.3f}")
    assert ratio == pytest.approx(1.0, abs=0.10)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_float32_master_moments_join_beside_the_new_weights(mesh_for, optimizer):
    """With float32 masters and two float32 moments XLA:CPU's peak is the concatenate that
    joins the new moments into one `f32[2n]` row: their leaves (its operands, `2n` floats),
    the joined row, the new weights' `f32[n]` row (made after the leaves: the update row
    added to the masters, the update's leaves and row dead) and the float32 gradient row
    (made before them) are live together. The planner counts the gradient row
    (`grads_update`) and, in `update_work`, the new weights' row and the moments twice, and
    its plan is within 10 %."""
    from jaxpod.inspect.compile import inspect_options
    from jaxpod.planner.bytes import _state_bytes
    from jaxpod.planner.counts import param_layout

    cfg = digits_cfg("precision.master=float32", f"optim.name={optimizer}")
    n = max(efficientnet_stage_params(cfg))
    _, compiled, (values, ranges, schedule) = dumped_step(cfg, mesh_for(cfg), inspect_options())
    peak = peak_position(values, ranges)
    assert schedule[peak].startswith("concatenate"), schedule[peak]
    assert values[schedule[peak]][2].startswith(f"f32[{2 * n}]"), schedule[peak]
    alive = _alive(values, ranges, peak)
    leaves = [
        (size, first, last)
        for dt, dims, size, (first, last) in alive.values()
        if dt == "f32" and len(dims) == 1 and dims[0] < n
    ]
    assert sum(size for size, _, last in leaves if last == peak) == 2 * n * 4  # the moments'
    assert sum(size for size, _, last in leaves if last > peak) == 0  # no update leaves
    made = sorted(r[0] for dt, dims, _, r in alive.values() if (dt, dims) == ("f32", (n,)))
    assert len(made) == 2, alive  # the gradient row and the new weights' row
    assert made[0] < min(first for _, first, _ in leaves) < max(f for _, f, _ in leaves) < made[1]
    assert [d for _, d, _, _ in alive.values() if d and d[0] > n] == [(2 * n,)], alive
    work = activation_bytes(cfg, CPU)["update_work"]
    assert work == (NEW_WEIGHTS_ROWS + 2 * 2) * n * 4
    assert _state_bytes(cfg, param_layout(cfg), CPU)["grads_update"] == n * 4
    ratio = planned_over_xla(cfg, compiled, CPU)
    print(f"planned / XLA {ratio:.3f}")
    assert ratio == pytest.approx(1.0, abs=0.10)

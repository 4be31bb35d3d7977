"""The packed EfficientNet update's values in XLA:CPU's compiled step, against the planner's
`update_work` (`jaxpod.planner.efficientnet`): the digits preset (4x2x1) with LAMB, whose
two 16-bit moments are one row of `2 n_max`, rounded in one go; its peak is that rounding."""

from __future__ import annotations

import pytest
from helpers import digits_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, planned_over_xla

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.counts import efficientnet_stage_params
from jaxpod.planner.efficientnet import MOMENT_ROUNDING_WORDS
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

"""What XLA:TPU saves of a layer without remat (libtpu, no TPU attached; the base GPT at
d 512, float32, remat none, on a v5p 2x2x1 slice, tensor 1 and 2): at the peak the stacked
residuals [L, b, ...] are the bfloat16 operands of the layer's matmuls beside the float32
values its elementwise backward needs, the planner's `_converted_saved`
(`jaxpod.planner.layer`, `DeviceProfile.converts_matrices`) for every layer, to the byte;
the row statistics ([..., 1]: the norms' and the softmax's) are left out of both.
"""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, peak_position, tpu_mesh

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x1", get_profile("tpu-v5p")
NONE = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
NONE += ("model.vocab=8192", "train.micro_batch=2", "train.grad_accum=2", "model.remat=none")
MESHES = {"tensor1": (4, 1, 1), "tensor2": (2, 1, 2)}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_the_layers_save_the_matmuls_bfloat16_operands(name):
    """At XLA's peak the [L, b, ...] values with a minor dimension above 1 take what the
    planner saves: `saved_per_layer` for each of the L layers."""
    cfg = make_tiny_cfg(*NONE, mesh=MESHES[name])
    _, _, (values, ranges, _) = dumped_step(cfg, tpu_mesh(MESHES[name], TARGET))
    peak = peak_position(values, ranges)
    layers, b = cfg.model.layers, cfg.train.micro_batch
    stacked = [
        values[v][0]
        for v, (first, last) in ranges.items()
        if first <= peak <= last
        and (dims := dims_of(values[v][2]))[:2] == (layers, b)
        and dims[-1] > 1
    ]
    assert layers != b  # a [L, b, ...] value is a layer stack, not a micro-batch's
    planned = activation_bytes(cfg, PROFILE)["saved_per_layer"]
    assert sum(stacked) == layers * planned, (len(stacked), sum(stacked), layers * planned)

"""What XLA:TPU's GPT step holds with RTS (libtpu, no TPU attached; a v5p 2x2x1 slice, float32
params and compute, remat full, two micro-batches), the expected bytes from the planner's terms:

- `converts_matrices`: a layer's gathered matrices are all-gathered in bfloat16 (the shard
  converted first), at most one layer's at once, no float32 gathered layer matrix
  anywhere (`jaxpod.planner.bytes._gather_bytes`);
- `accumulates_in_place`: the non-layer gradients (the tied table, the position table) are
  accumulated whole, not as RTS's shard, once, through the layers' backward, and the
  gathered tables are dead by then (`_in_place_grads`, `device_bytes`);
- `head_grads_at_once`: the program has one float32 logits value [b·T, V/t]: the softmax,
  the loss and its cotangent are fused into its consumers (`activations.fused_head`).
"""

from __future__ import annotations

import math

import jax
import pytest
from helpers.dumps import dims_of, layer_ranges, tpu_probe

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.bytes import _gathered_bytes, _widths, device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.profiles import get_profile
from jaxpod.target.hlo_text import shape_bytes
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x1", get_profile("tpu-v5p")
D512 = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
SHAPE = (*D512, "model.vocab=8192", "train.grad_accum=2", "memory.device=tpu-v5p")
PROBES = {  # name: (overrides, (replica, pipeline, tensor))
    "rts4-adamw": ((*SHAPE, "model.remat=full", "memory.rts=4"), (4, 1, 1)),
    "rts2-lamb-tensor2": (
        (*SHAPE, "model.remat=full", "memory.rts=2", "optim.name=lamb"),
        (2, 1, 2),
    ),
}


@pytest.fixture(scope="module", params=sorted(PROBES))
def probe(request):
    """`(cfg, state, module, (values, ranges, schedule))` of one probe's compiled step."""
    return tpu_probe(*PROBES[request.param], TARGET)


def _backward_peak(cfg, values: dict, ranges: dict, schedule: dict) -> int:
    """The position at which the short-lived temporaries of the micro-batch's shape ([b, ...]
    or [1, b, ...], rank 3 or more: one layer's values) cover the most bytes."""
    layer, steps = layer_ranges(cfg, values, ranges, schedule), max(schedule) + 1
    return max(range(steps), key=lambda t: covered(values, layer, t))


def _alive(ranges: dict, t: int) -> list[str]:
    return [name for name, (a, b) in ranges.items() if a <= t <= b]


def _gathers(module, dtype: str) -> dict[str, tuple[int, ...]]:
    """All-gather outputs of `dtype` in the program: name -> dims."""
    found = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode == "all-gather" and inst.type.startswith(f"{dtype}["):
                found[inst.name] = dims_of(inst.type)
    return found


def test_a_layer_is_gathered_in_bfloat16(probe):
    """At most one layer's four matrices are alive at once as bfloat16 all-gathers (the RTS
    shard converted, then gathered), and no float32 layer matrix is gathered: the planner's
    gathered layer is its step at 2 bytes a scalar (`converts_matrices`)."""
    cfg, state, module, (values, ranges, schedule) = probe
    rts, layers = cfg.memory.rts, cfg.model.layers
    widths = (cfg.model.d_model, cfg.model.d_ff)
    stack = [x for x in jax.tree.leaves(state.params["layers"]) if x.ndim >= 3]
    shards = [x.sharding.shard_shape(x.shape) for x in stack if x.shape[1] in widths]
    per_layer = sorted(math.prod(s) * rts // layers for s in shards)
    assert len(per_layer) == 4
    bf16 = _gathers(module, "bf16")
    layer = {n: r for n, r in ranges.items() if n in bf16 and bf16[n][0] == 1}
    most = max(range(max(schedule) + 1), key=lambda t: covered(values, layer, t))
    alive = _alive(layer, most)  # the most of the gathered layers alive at once
    assert sorted(math.prod(bf16[n]) for n in alive) == per_layer
    f32 = _gathers(module, "f32")
    layer_f32 = [dims for dims in f32.values() if len(dims) >= 3 and dims[0] == 1]
    assert layer_f32  # W_qkv's bias is gathered in float32: the filter sees layers
    assert not [dims for dims in layer_f32 if math.prod(dims) in per_layer]
    found = sum(shape_bytes(module.type_of(n)) for n in alive)
    assert found == 2 * sum(per_layer)
    d, f, qkv, f_in = _widths(cfg)
    matrices = d * (qkv + d + f_in + f) // cfg.mesh.tensor
    assert matrices == sum(per_layer)
    step = param_layout(cfg)["local_layers"] / layers  # biases and norms too, in bfloat16
    gathered_layer = _gathered_bytes(cfg, param_layout(cfg), PROFILE)[1]
    assert gathered_layer == 2 * step
    assert 0 <= gathered_layer - found <= 2 * (step - matrices)


def test_the_non_layer_gradients_are_accumulated_whole(probe):
    """At the layers' backward each non-layer matrix (the tied table, the position table)
    has one long-lived float32 value of its whole shape on the tensor device (RTS's shard
    times `rts` along one axis), the accumulator; none of the tables' gathered copies is
    alive. The planner's gradients hold the stack twice as RTS's shard and the non-layer
    parameters once whole; its layers' backward has one layer's gathered weights."""
    cfg, state, module, (values, ranges, schedule) = probe
    rts, steps = cfg.memory.rts, max(schedule) + 1
    other = [x for key, x in state.params.items() if key != "layers"]
    shards = [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(other) if x.ndim == 2]
    assert len(shards) == 2
    peak = _backward_peak(cfg, values, ranges, schedule)
    gathered = set(_gathers(module, "f32"))
    long_f32 = [
        n
        for n in _alive(ranges, peak)
        if values[n][2].startswith("f32[") and ranges[n][1] - ranges[n][0] >= steps // 8
    ]
    for shard in shards:
        wholes = {shard[:i] + (shard[i] * rts,) + shard[i + 1 :] for i in range(len(shard))}
        copies = [n for n in _alive(ranges, peak) if n in gathered]
        assert not [n for n in copies if dims_of(values[n][2]) in wholes]
        found = [n for n in long_f32 if dims_of(values[n][2]) in wholes]
        assert len(found) == 1, shard
        assert values[found[0]][0] == 4 * math.prod(shard) * rts
    layout = param_layout(cfg)
    planned = device_bytes(cfg, layout, activation_bytes(cfg, PROFILE), PROFILE)
    assert planned["grads"] == int((2 * layout["local_layers"] / rts + layout["local_other"]) * 4)


def test_the_head_holds_one_float32_logits_value(probe):
    """The whole program has one temporary of the logits' shape [b·T, V/t] (float32): the
    planner's head counts its logits once (`fused_head`), a third of the unfused term."""
    cfg, _, _, (values, _, _) = probe
    md = cfg.model
    logits = (cfg.train.micro_batch * md.seq_len, md.vocab // cfg.mesh.tensor)
    found = [n for n, v in values.items() if v[2].startswith("f32[") and dims_of(v[2]) == logits]
    assert len(found) == 1
    rows = cfg.train.micro_batch * md.seq_len * md.d_model * 4 * 4  # the final LN's values
    head = activation_bytes(cfg, PROFILE)["head"]
    assert head - rows == values[found[0]][0] == 4 * math.prod(logits)

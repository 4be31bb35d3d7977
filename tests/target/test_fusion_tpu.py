"""Two properties of the TPU profiles found in XLA:TPU's compiled GPT steps (libtpu, no TPU
attached; a v5p 2x2x1 slice), the expected bytes from the planner's own terms:

- `converts_matrices`: with float32 params and compute, the entry computation makes one
  bfloat16 copy of each stacked layer matrix (W_qkv, W_o, W_in, W_out: the chip's shard,
  every layer), alive from before the layer loops to the update, and of no other parameter of
  the stack; with bfloat16 compute none (the step casts each layer's weights itself);
- `fuses_recomputation`: the micro-batch-shaped temporaries of one layer's backward, at their
  largest, take the planner's `layer_work` (`jaxpod.planner.layer._fused_work`) within
  `cb + 4` bytes a [b, T, D] row: the residual rows at the peak vary with the shapes
  (the layer's input, the cotangent, a psum's output, queries' and keys' copies);
- `head_grads_at_once`: with float32 compute no value of the head's shapes (the logits'
  cotangent [b·T, V/t], a [b, T, D] row) waits through the layers' backward; with bfloat16
  compute the logits' cotangent does, and the planner keeps its CPU-read term;
- `accumulates_in_place`: at the layers' backward one gradient buffer of each matrix outside
  the stack (the tied table's shard, the position table) is alive, the accumulator.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import pytest
from helpers.dumps import dims_of, layer_ranges, tpu_probe

from jaxpod.planner.activations import activation_bytes, compute_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.profiles import get_profile
from jaxpod.target.hlo_text import shape_bytes
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x1", get_profile("tpu-v5p")
SHAPE = ("model.seq_len=256", "model.vocab=8192", "train.grad_accum=2", "memory.device=tpu-v5p")
D256 = ("model.d_model=256", "model.heads=4", "model.d_ff=1024", *SHAPE)
D512 = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", *SHAPE)
PROBES = {  # name: (overrides, (replica, pipeline, tensor))
    "d256-full": ((*D256, "model.remat=full"), (4, 1, 1)),
    "d512-full-tensor4": ((*D512, "model.remat=full"), (1, 1, 4)),
    "d512-attention-tensor2": ((*D512, "model.remat=attention"), (2, 1, 2)),
    "d512-bf16-full": ((*D512, "model.remat=full", "precision.compute=bfloat16"), (4, 1, 1)),
}


@pytest.fixture(scope="module", params=sorted(PROBES))
def probe(request):
    """`(cfg, state, module, (values, ranges, schedule))` of one probe's compiled step."""
    return tpu_probe(*PROBES[request.param], TARGET)


def _planned(cfg, profile) -> dict:
    return device_bytes(cfg, param_layout(cfg), activation_bytes(cfg, profile), profile)


MOVES = ("copy-start", "copy-done", "copy", "bitcast")


def _source(module, name: str, params: set) -> str:
    """The instruction `name`'s value comes from through moves and bitcasts (`MOVES`), up to
    an entry parameter (`params`)."""
    inst = module.instructions.get(name)
    while inst is not None and inst.opcode in MOVES and name not in params:
        name = inst.operands[0]
        inst = module.instructions.get(name)
    return name


def _entry_params(module) -> set:
    """Names of the entry computation's parameters (the step's arguments)."""
    entry = module.computations[module.entry].instructions
    return {i.name for i in entry if i.opcode == "parameter"}


def _weight_copies(module) -> list[str]:
    """Entry instructions making a bfloat16 array of an entry parameter's float32 value with
    the same dimensions (a convert, or a copy that converts), through moves and bitcasts."""
    entry = module.computations[module.entry].instructions
    params, moves = _entry_params(module), MOVES
    source = lambda name: _source(module, name, params)  # noqa: E731

    found = []
    for inst in entry:
        if inst.opcode in moves[:2] or not inst.type.startswith("bf16[") or not inst.operands:
            continue
        src = source(inst.operands[0])
        f32 = module.type_of(src)
        if src in params and f32.startswith("f32[") and dims_of(f32) == dims_of(inst.type):
            found.append(inst.name)
    return found


def _layer_peak(cfg, values: dict, ranges: dict, schedule: dict) -> tuple[int, int]:
    """`(bytes, position)`: the most that the temporaries of the micro-batch's shape ([b, ...]
    or [1, b, ...], rank 3 or more) alive for under an eighth of the schedule (one layer's
    values, not the saved stack or the carries) cover at one moment."""
    layer, steps = layer_ranges(cfg, values, ranges, schedule), max(schedule) + 1
    return max((covered(values, layer, t), t) for t in range(steps))


def test_float32_layer_matrices_get_one_bfloat16_copy(probe):
    """The stacked matrices' shards, and only they, get a bfloat16 copy in the entry
    computation, alive at the layers' backward; the planner counts their bytes
    (`converts_matrices`). With bfloat16 compute no matrix gets one."""
    cfg, state, module, (values, ranges, schedule) = probe
    copies = _weight_copies(module)
    widths = (cfg.model.d_model, cfg.model.d_ff)  # [L, D, ...] or [L, F, D]: not biases
    stack = jax.tree.leaves(state.params["layers"])
    matrices = [x for x in stack if x.ndim >= 3 and x.shape[1] in widths]
    shards = sorted(tuple(x.sharding.shard_shape(x.shape)) for x in matrices)
    assert len(shards) == 4
    no_copies = replace(PROFILE, converts_matrices=False)
    planned = _planned(cfg, PROFILE)["weights"] - _planned(cfg, no_copies)["weights"]
    if cfg.precision.compute != "float32":
        assert not [c for c in copies if dims_of(module.type_of(c)) in shards]
        assert planned == 0
        return
    assert sorted(dims_of(module.type_of(c)) for c in copies) == shards
    assert sum(shape_bytes(module.type_of(c)) for c in copies) == planned
    _, backward = _layer_peak(cfg, values, ranges, schedule)
    for copy in copies:
        assert ranges[copy][0] <= backward <= ranges[copy][1], copy


def test_a_recomputed_layer_holds_the_fused_working_set(probe):
    """One layer's backward at its peak holds the planner's fused working set
    (`fuses_recomputation`) within `cb + 4` bytes a [b, T, D] row, half or less of what
    the CPU program's working set (every value autodiff saves of the layer) would count."""
    cfg, _, _, (values, ranges, schedule) = probe
    held, _ = _layer_peak(cfg, values, ranges, schedule)
    cb = compute_bytes(cfg, PROFILE)
    row = cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model
    planned = activation_bytes(cfg, PROFILE)["layer_work"]
    assert abs(held - planned) <= (cb + 4) * row, (held, planned)
    cpu_term = activation_bytes(cfg, replace(PROFILE, fuses_recomputation=False))["layer_work"]
    assert 2 * held <= cpu_term


def _alive(values: dict, ranges: dict, t: int) -> list[tuple[str, tuple[int, ...]]]:
    """`(name, dims)` of the temporaries alive at position `t`."""
    return [(v, dims_of(values[v][2])) for v, (a, b) in ranges.items() if a <= t <= b]


def test_a_float32_head_keeps_nothing_through_the_layers_backward(probe):
    """At the layers' backward peak no value of the loss head's shapes outlives a layer (an
    eighth of the schedule) with float32 compute: the planner keeps nothing
    (`head_grads_at_once`). With bfloat16 compute the logits' cotangent waits, and the
    planner keeps the CPU-read operands (`_head_kept`)."""
    cfg, _, _, (values, ranges, schedule) = probe
    md, steps = cfg.model, max(schedule) + 1
    b, t, v = cfg.train.micro_batch, md.seq_len, md.vocab // cfg.mesh.tensor
    head = {(b * t, v), (b, t, v), (b, t, md.d_model), (b * t, md.d_model)}
    _, backward = _layer_peak(cfg, values, ranges, schedule)
    kept = [
        name
        for name, dims in _alive(values, ranges, backward)
        if dims in head and ranges[name][1] - ranges[name][0] >= steps // 8
    ]
    found = sum(values[name][0] for name in kept)
    planned = activation_bytes(cfg, PROFILE)["head_kept"]
    cpu_term = activation_bytes(cfg, replace(PROFILE, head_grads_at_once=False))["head_kept"]
    assert cpu_term > 0
    if cfg.precision.compute == "float32":
        assert found == planned == 0, kept
        return
    assert (b * t, v) in [dims_of(values[name][2]) for name in kept]
    assert planned == cpu_term


def test_the_non_layer_gradients_are_accumulated_in_place(probe):
    """At the layers' backward peak one float32 buffer of each non-layer matrix's shard shape
    (the tied table, the position table) outlives a layer (an eighth of the schedule), not a
    copy of a weight, the accumulator, which the head's and the embedding's gradients are
    added into: the planner counts those gradients once (`accumulates_in_place`), the
    stack's twice."""
    cfg, state, module, (values, ranges, schedule) = probe
    params = _entry_params(module)
    other = [x for key, x in state.params.items() if key != "layers"]
    matrices = [x for x in jax.tree.leaves(other) if x.ndim == 2]
    shards = [tuple(x.sharding.shard_shape(x.shape)) for x in matrices]
    assert len(set(shards)) == len(shards) == 2
    _, backward = _layer_peak(cfg, values, ranges, schedule)
    steps = max(schedule) + 1
    alive = [  # long-lived float32 values, less the weights' relaid-out copies
        (name, dims)
        for name, dims in _alive(values, ranges, backward)
        if values[name][2].startswith("f32[")
        and ranges[name][1] - ranges[name][0] >= steps // 8
        and _source(module, name, params) not in params
    ]
    for shard in shards:
        assert len([name for name, dims in alive if dims == shard]) == 1, shard
    found = sum(values[name][0] for name, dims in alive if dims in shards)
    assert found == sum(4 * math.prod(shard) for shard in shards)
    twice = _planned(cfg, replace(PROFILE, accumulates_in_place=False))["grads"]
    once = twice - 4 * param_layout(cfg)["local_other"]
    assert _planned(cfg, PROFILE)["grads"] == once

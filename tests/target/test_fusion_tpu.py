"""Two properties of the TPU profiles found in XLA:TPU's compiled GPT steps (libtpu, no TPU
attached; a v5p 2x2x1 slice), the expected bytes from the planner's own terms:

- `converts_matrices`: with float32 params and compute, the entry computation makes one
  bfloat16 copy of each stacked layer matrix (W_qkv, W_o, W_in, W_out: the chip's shard,
  every layer), alive from before the layer loops to the update, and of no other parameter of
  the stack; with bfloat16 compute none (the step casts each layer's weights itself);
- `fuses_recomputation`: the micro-batch-shaped temporaries of one layer's backward, at their
  largest, take the planner's `layer_work` (`jaxpod.planner.layer._fused_work`) within
  `cb + 4` bytes a [b, T, D] row: the residual rows at the peak vary with the shapes
  (the layer's input, the cotangent, a psum's output, queries' and keys' copies).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import jax
import pytest
from helpers import make_tiny_cfg

from jaxpod.planner.activations import activation_bytes, compute_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.profiles import get_profile
from jaxpod.target.buffers import DUMP_OPTIONS
from jaxpod.target.hlo_text import parse, shape_bytes
from jaxpod.target.live_ranges import covered, temporaries

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
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    overrides, mesh = PROBES[request.param]
    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    engine, state, batch = abstract_inputs(
        cfg, torus_mesh(mesh, target_devices(parse_target(TARGET)))
    )
    lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
    with tempfile.TemporaryDirectory(prefix="jaxpod-fusion-") as dump:
        compiled = lowered.compile(compiler_options={**DUMP_OPTIONS, "xla_dump_to": dump})
        live = temporaries(dump)
    return cfg, state, parse(compiled.as_text()), live


def _planned(cfg, profile) -> dict:
    return device_bytes(cfg, param_layout(cfg), activation_bytes(cfg, profile), profile)


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape.split("[", 1)[1].split("]")[0].split(",") if d)


def _weight_copies(module) -> list[str]:
    """Entry instructions making a bfloat16 array of an entry parameter's float32 value with
    the same dimensions (a convert, or a copy that converts), through moves and bitcasts."""
    entry = module.computations[module.entry].instructions
    params = {i.name for i in entry if i.opcode == "parameter"}
    moves = ("copy-start", "copy-done", "copy", "bitcast")

    def source(name: str) -> str:
        inst = module.instructions.get(name)
        while inst is not None and inst.opcode in moves and name not in params:
            name = inst.operands[0]
            inst = module.instructions.get(name)
        return name

    found = []
    for inst in entry:
        if inst.opcode in moves[:2] or not inst.type.startswith("bf16[") or not inst.operands:
            continue
        src = source(inst.operands[0])
        f32 = module.type_of(src)
        if src in params and f32.startswith("f32[") and _dims(f32) == _dims(inst.type):
            found.append(inst.name)
    return found


def _layer_peak(cfg, values: dict, ranges: dict, schedule: dict) -> tuple[int, int]:
    """`(bytes, position)`: the most that the temporaries of the micro-batch's shape ([b, ...]
    or [1, b, ...], rank 3 or more) alive for under an eighth of the schedule (one layer's
    values, not the saved stack or the carries) cover at one moment."""
    b, steps = cfg.train.micro_batch, max(schedule) + 1

    def layer_value(name: str) -> bool:
        dims = _dims(values[name][2])
        batch = dims[:1] == (b,) or dims[:2] == (1, b)
        first, last = ranges[name]
        return len(dims) >= 3 and batch and last - first < steps // 8

    assert cfg.model.layers != b  # the saved stack [L, b, T, D] is not a layer's value
    layer = {name: r for name, r in ranges.items() if layer_value(name)}
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
        assert not [c for c in copies if _dims(module.type_of(c)) in shards]
        assert planned == 0
        return
    assert sorted(_dims(module.type_of(c)) for c in copies) == shards
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

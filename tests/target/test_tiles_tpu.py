"""XLA:TPU's tiles in the compiled step of a small EfficientNet (no TPU attached): the values
the pipelined stages save for their backward and a stepwise pipeline's copy of the image
batch are padded exactly as the TPU profile's `tile` says (`jaxpod.planner.tiles`), and the
planner counts the copy."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import digits_cfg

from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.profiles import get_profile
from jaxpod.target.hlo_text import parse, shape_bytes, split_tuple

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x2", get_profile("tpu-v5p")
# float16 activations, float32 GroupNorm values; without remat each stage's `lax.switch`
# branch returns the values its backward reads: the program's stored activations
OVERRIDES = ("model.remat=none", "train.pipeline_schedule=gpipe", "memory.device=tpu-v5p")
STEPWISE = ("train.pipeline_schedule=1f1b", "model.image_size=64", "train.micro_batch=2")
STEPWISE += ("memory.device=tpu-v5p",)


def _compile(cfg):
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    shape = (cfg.mesh.replica, cfg.mesh.pipeline, cfg.mesh.tensor)
    mesh = torus_mesh(shape, target_devices(parse_target(TARGET)))
    engine, state, batch = abstract_inputs(cfg, mesh)
    lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
    return parse(lowered.compile().as_text())


@pytest.fixture(scope="module")
def program():
    cfg = digits_cfg(*OVERRIDES)
    return cfg, _compile(cfg)


def _array(shape: str) -> tuple[str, tuple[int, ...], str]:
    """`(dtype, dims, layout)` of an array shape `f32[2,3]{1,0:T(2,128)}`."""
    dtype, rest = shape.split("[", 1)
    dims, layout = rest.split("]", 1)
    return dtype, tuple(int(d) for d in dims.split(",") if d), layout


def _row_major(layout: str, rank: int) -> bool:
    order = layout.strip("{}").split(":")[0]
    return order == ",".join(str(d) for d in reversed(range(rank))) and "T(" in layout


def test_saved_activations_are_padded_as_the_profile_says(program):
    """Every image-shaped value `[mb, H, W, C]` (and GroupNorm's `[mb, H, W, G, C/G]`) the
    stages' switch returns, laid out row-major, takes the profile's tile: its bytes from its
    layout equal the tile's arithmetic; together several times their logical bytes."""
    cfg, module = program
    mb, found, padded, logical = cfg.train.micro_batch, 0, 0, 0
    for inst in module.instructions.values():
        if inst.opcode != "conditional":
            continue
        for shape in split_tuple(inst.type):
            dtype, dims, layout = _array(shape) if "[" in shape else ("", (), "")
            if len(dims) < 4 or dims[0] != mb or not _row_major(layout, len(dims)):
                continue
            itemsize = np.dtype({"f32": np.float32, "f16": np.float16}[dtype]).itemsize
            assert shape_bytes(shape, padded=True) == PROFILE.tile.padded(dims, itemsize) * (
                itemsize
            ), shape
            found += 1
            padded += shape_bytes(shape, padded=True)
            logical += shape_bytes(shape)
    assert found >= 20
    assert padded > 3 * logical


def test_a_stepwise_pipeline_copies_the_image_batch_into_tiles(program):
    """1F1B's ticks read the uint8 batch `[G, H, W, 3]` from a channels-minor copy (3 channels
    -> 128; at 64 pixels, 2 images a micro-batch, as the calibration row's), which the
    planner's `input_copy` for the TPU profile is; GPipe's read the argument: no copy."""
    cfg = digits_cfg(*STEPWISE)
    g, hw = cfg.part_micro * cfg.train.micro_batch, cfg.model.image_size
    module = _compile(cfg)
    copies = [i for i in module.instructions.values() if _is_batch_copy(i.type, g, hw)]
    assert copies
    assert _input_copy(cfg) == shape_bytes(copies[0].type, padded=True)
    assert _input_copy(cfg) > 40 * shape_bytes(copies[0].type)
    gpipe_cfg, gpipe = program
    g, hw = gpipe_cfg.part_micro * gpipe_cfg.train.micro_batch, gpipe_cfg.model.image_size
    assert not [i for i in gpipe.instructions.values() if _is_batch_copy(i.type, g, hw)]
    assert _input_copy(gpipe_cfg) == 0


def _is_batch_copy(shape: str, images: int, hw: int) -> bool:
    """A uint8 `[images, hw, hw, 3]` array laid out channels-minor, tiled."""
    if not shape.startswith(f"u8[{images},{hw},{hw},3]"):
        return False
    return _row_major(_array(shape)[2], 4)


def _input_copy(cfg) -> int:
    acts = activation_bytes(cfg, PROFILE)
    return device_bytes(cfg, param_layout(cfg), acts, PROFILE)["input_copy"]


def test_16bit_state_rows_take_two_rows_as_the_planner_counts(program):
    """The packed stages' state rows `f16[1, n]` (the weights' and the moments') are laid
    out `T(2,128)(2,1)`: one 32-bit word's rows, twice their logical bytes in HBM; the
    planner's weights and optimizer state for the TPU profile are those padded bytes
    (`jaxpod.planner.bytes.row_padding`), within the rows' lane padding."""
    cfg, module = program
    entry = module.computations[module.entry]
    rows = [
        i.type
        for i in entry.instructions
        if i.opcode == "parameter" and i.type.startswith("f16[1,")
    ]
    assert len(rows) == 2 and all("T(2,128)(2,1)" in t for t in rows), rows
    padded = sum(shape_bytes(t, padded=True) for t in rows)
    assert padded == pytest.approx(2 * sum(shape_bytes(t) for t in rows), rel=1e-3)
    planned = device_bytes(cfg, param_layout(cfg), activation_bytes(cfg, PROFILE), PROFILE)
    assert planned["weights"] + planned["optimizer"] == pytest.approx(padded, rel=1e-3)

"""`DeviceProfile.grouped_conv_copies` found in XLA:TPU's compiled step (libtpu, no TPU
attached): the EfficientNet-B4 G16 v5e preset's mapping cut to three block groups (stages:
the stem and blocks 1a to 2d, then 3a to the head) at 190 pixels, 2 images a micro-batch,
2 replicas on a v5e 2x2 slice. Every grouped spatial conv of the stem's stage has bfloat16
copies of its operand and of its output's cotangent laid out `[mb, H, W, groups, group
size]` (`{4,0,3,2,1:T(2,128)(2,1)}`: the group's channels minor, the micro-batch
second-minor), their bytes the tile's arithmetic (`jaxpod.planner.grouped_convs`); the
planner with them is within 10 % of XLA's HBM total, without them far below it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers.dumps import dims_of, dumped_program, tpu_mesh

from jaxpod.config import load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import param_layout
from jaxpod.planner.efficientnet_pieces import pieces
from jaxpod.planner.grouped_convs import grouped_elements
from jaxpod.planner.profiles import get_profile
from jaxpod.target.buffers import device_memory_bytes

pytestmark = pytest.mark.slow

PROFILE = get_profile("tpu-v5e")
PRESET = Path(__file__).parents[2] / "configs" / "efficientnet_b4_g16_tpu_v5e16.yaml"
PROBE = ("devices=4", "mesh.replica=2", "model.block_groups=3", "model.pipeline_splits=[3a]")
PROBE += ("model.image_size=190", "train.micro_batch=2", "train.grad_accum=4")
PROBE += ("train.batch_parts=1",)
LAYOUT = "{4,0,3,2,1:T(2,128)(2,1)}"  # 2 bfloat16 images: one 32-bit word's rows


@pytest.fixture(scope="module")
def program():
    """`(cfg, {shape: bytes} of the grouped-layout temporaries, XLA's HBM total)`."""
    cfg = load_config(PRESET, PROBE)
    dumped = dumped_program(cfg, tpu_mesh((2, 2, 1), "tpu-v5e:2x2"), device_only=True)
    values, _, _ = dumped.live
    grouped = {}
    for size, _, shape in values.values():
        if shape.endswith(LAYOUT) and len(dims_of(shape)) == 5:
            grouped.setdefault(shape.split("{")[0], set()).add(size)
    return cfg, grouped, device_memory_bytes(dumped.spaces)


def test_each_grouped_conv_has_its_copies_padded_as_planned(program):
    """For each grouped conv of the stem's stage, bfloat16 `[mb, H, W, C/g, g]` copies at
    its input's size (its operand) and its output's (its output's cotangent), each taking
    the tile's padded bytes: 2 images take 2 rows, 12 or 16 channels 128 lanes."""
    cfg, grouped, _ = program
    mb, tile = cfg.train.micro_batch, PROFILE.tile
    convs = [p["grouped_conv"] for p in pieces(cfg, 2, 2, tile)[0] if p.get("grouped_conv")]
    assert len(convs) == 6  # 1a, 1b, 2a to 2d
    for h_in, h_out, channels, group in convs:
        for hw in (h_in, h_out):
            shape = f"bf16[{mb},{hw},{hw},{channels // group},{group}]"
            padded = 2 * grouped_elements(tile, mb, hw, channels, group, 2)
            assert grouped.get(shape) == {padded}, (shape, grouped.get(shape))
            assert padded == 2 * hw * hw * (channels // group) * 2 * 128


def _planned(cfg, profile) -> int:
    acts = activation_bytes(cfg, profile)
    return device_bytes(cfg, param_layout(cfg), acts, profile)["device_total"]


def test_the_plan_is_within_10_percent_with_the_copies_only(program):
    """Planned over XLA:TPU's HBM bytes (the memory spaces but VMEM and SMEM): within 10 %
    with the copies, below 0.7 without them."""
    cfg, _, hbm = program
    without = dataclasses.replace(PROFILE, grouped_conv_copies=False)
    assert 0.9 < _planned(cfg, PROFILE) / hbm < 1.1
    assert _planned(cfg, without) / hbm < 0.7

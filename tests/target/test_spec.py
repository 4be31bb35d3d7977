"""`--target` names: parsed to the generation, its profile and chips, or refused in one line;
the configs a target's compiler is known to reject, refused before it runs."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

from jaxpod.errors import UserError
from jaxpod.planner.profiles import PROFILES
from jaxpod.target.spec import (
    GENERATIONS,
    check_compiles,
    check_mesh_fits,
    check_platform_compiles,
    parse_target,
)


@pytest.mark.parametrize(
    ("text", "topology", "chips", "profile"),
    [
        ("tpu-v5p:2x2x4", "v5p:2x2x4", 16, "tpu-v5p"),
        ("tpu-v4:2x2x2", "v4:2x2x2", 8, "tpu-v4"),
        ("tpu-v5e:4x4", "v5e:4x4", 16, "tpu-v5e"),
        ("tpu-v6e:16x16", "v6e:16x16", 256, "tpu-v6e"),
        ("h100:8", "h100:8", 8, "h100-80gb"),
    ],
)
def test_a_target_names_its_topology_chips_and_profile(text, topology, chips, profile):
    target = parse_target(text)
    assert (target.topology_name, target.chips, target.profile) == (topology, chips, profile)


def test_every_generation_has_a_planner_profile():
    assert {g.profile for g in GENERATIONS.values()} <= set(PROFILES)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tpu-v7:2x2", "names no target; write one like tpu-v5p:2x2x4"),
        ("v5p-32", "names no target"),
        ("tpu-v5p:4x4", "TPU v5p is a 3-D torus; give 3 axis sizes, tpu-v5p:NxNxN"),
        ("tpu-v5e:2x2x2", "TPU v5e is a 2-D torus; give 2 axis sizes"),
        ("tpu-v5e:0x4", "give 2 axis sizes"),
        ("h100:16", "name 1 to 8 GPUs of one host"),
    ],
)
def test_a_wrong_target_is_one_line(text, needle):
    with pytest.raises(UserError, match=needle) as info:
        parse_target(text)
    assert "\n" not in str(info.value)


def test_the_mesh_must_have_the_targets_chips():
    check_mesh_fits(parse_target("tpu-v5p:2x2x4"), 16)
    with pytest.raises(UserError, match="has 16 chips but the mesh has 8 devices"):
        check_mesh_fits(parse_target("tpu-v5p:2x2x4"), 8)


SKIPPING = ("memory.offload=[activations]", "train.skip_bubbles=true")


@pytest.mark.parametrize(
    ("overrides", "target", "refused"),
    [
        (SKIPPING, "tpu-v5p:2x2x2", True),
        (
            (*SKIPPING, "train.pipeline_schedule=circular", "train.virtual_stages=2"),
            "tpu-v5e:2x4",
            True,
        ),
        (SKIPPING[:1], "tpu-v5p:2x2x2", False),  # gpipe offloads, its layers looped
        ((*SKIPPING, "model.remat=full"), "tpu-v5p:2x2x2", False),  # nothing offloaded
        (SKIPPING, "h100:8", False),  # XLA:GPU's program is not read here
    ],
    ids=["gpipe", "circular", "no-skipping", "remat-full", "gpu"],
)
def test_a_program_xla_tpu_rejects_is_refused_before_compiling(overrides, target, refused):
    """Offloaded activations under gpipe or circular skipping their bubbles: XLA:TPU
    (libtpu 0.0.42) rejects the program (tests/target/test_offload_tpu.py's xfail), so
    `--target` refuses the config in one line naming the fields and the fix."""
    cfg = make_tiny_cfg(*overrides, mesh=(2, 2, 2))
    if not refused:
        check_compiles(parse_target(target), cfg)
        return
    with pytest.raises(UserError, match="set train.skip_bubbles=false") as info:
        check_compiles(parse_target(target), cfg)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("train.skip_bubbles=true with memory.offload=[activations]")


def test_a_run_on_tpu_devices_is_refused_like_a_tpu_target():
    """`jaxpod train` on a TPU host checks its devices' platform with the same rule, so the
    run stops in one line before XLA:TPU's internal error; on CPU it trains."""
    cfg = make_tiny_cfg(*SKIPPING, mesh=(2, 2, 2))
    with pytest.raises(UserError, match="XLA:TPU cannot compile it for these devices"):
        check_platform_compiles("tpu", "these devices", cfg)
    check_platform_compiles("cpu", "these devices", cfg)

"""The pod presets: BERT-Large on POD16 (pipeline 4 and pipeline 8), GPT-3 175B on POD256, and
their `_emulated` variants. The planner checks are analytic and instant; compiling and
training the presets through the CLI is tests/presets/test_preset_runs.py."""

from __future__ import annotations

import math

import pytest
from helpers import ROOT

from jaxpod.config import load_config
from jaxpod.planner.plan import plan

CONFIGS = ROOT / "configs"
PRESETS = [
    "bert_large_pod16",
    "bert_large_pod16_pipeline8",
    "bert_large_pod16_emulated",
    "gpt3_175b_pod256",
    "gpt3_175b_pod256_emulated",
]
GC200 = 900 * 10**6


def preset(name: str, *overrides: str):
    return load_config(CONFIGS / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_plans(name):
    cfg = preset(name)
    p = plan(cfg)
    assert p["devices"] == cfg.devices == math.prod(cfg.mesh.shape)
    assert p["global_batch"] == cfg.train.micro_batch * cfg.mesh.replica * cfg.train.grad_accum


@pytest.mark.parametrize("name", PRESETS)
def test_preset_triggers_no_warning(name):
    """A preset is a recipe someone would run: none of the tool's own warnings."""
    assert preset(name).warnings() == []


def test_bert_large_pod16_plan():
    """4 stages x 4 replicas, RTS 4: 335 M parameters, 1/16 of them stored per device; fits
    the GC200 with the float32 LAMB state resting in streaming memory (moved in whole for the
    update), not without RTS."""
    p = plan(preset("bert_large_pod16"))
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (16, 4, 4, 1)
    assert abs(p["params"] - 335e6) / 335e6 < 0.02
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 16)
    assert p["device_profile"] == "ipu-gc200" and p["device_memory_bytes"] == GC200
    b = p["bytes_per_device"]
    assert p["fits"] and b["host_total"] == b["moved_in"] > 0  # the LAMB state, whole
    assert not plan(preset("bert_large_pod16", "memory.rts=1", "memory.rts_optimizer=1"))["fits"]


def test_bert_large_pipeline8_fits_model_and_optimizer_on_chip():
    p = plan(preset("bert_large_pod16_pipeline8"))
    b = p["bytes_per_device"]
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (16, 2, 8, 1)
    assert abs(p["params"] - 335e6) / 335e6 < 0.02
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 16)  # pipeline 8 x RTS 2
    assert p["fits"] and not p["offload"]
    assert b["optimizer"] > 0 and b["host_total"] == 0 and b["device_total"] <= GC200


def test_gpt3_175b_pod256_plan():
    """175 B parameters on 8 x 8 x 4 devices; 1/(t·p·rts) = 1/256 of the weights stored per
    device. The planner counts what the compiled step does: the host-resident stage stack on
    the device for the whole step (whatever the phases), the LAMB state moved in whole for the
    update. It does not fit the GC200 (by 11x) and says so; it fits an H100."""
    p = plan(preset("gpt3_175b_pod256"))
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (256, 4, 8, 8)
    assert abs(p["params"] - 175e9) / 175e9 < 0.01
    assert p["weight_fraction_per_device"] == pytest.approx(1 / (8 * 8 * 4))
    assert (p["rts"], p["configured_phases"]) == (4, 12)
    assert set(p["offload"]) == {"params", "optimizer"}
    assert (p["configured_stream"], p["mlp_panels"], p["vocab_slices"]) == ("matrix", 8, 16)
    b = p["bytes_per_device"]
    # the weights stored per device (1/256, float16) are all on the device during the step
    fp16 = 2
    assert b["weights"] == pytest.approx(p["params"] / 256 * fp16, rel=0.03)
    assert b["grads"] == b["weights"]
    assert b["moved_in"] == pytest.approx(2 * p["params"] / 256 * 4, rel=0.03)  # LAMB, f32
    assert b["peak"] == "update" and not p["fits"]
    assert b["device_total"] > 10 * GC200
    # the phases change no byte on the device (the stack is moved in whole)
    assert plan(preset("gpt3_175b_pod256", "memory.phases=1"))["bytes_per_device"] == b
    assert p["host_fits"] and plan(preset("gpt3_175b_pod256", "memory.device=h100-80gb"))["fits"]


@pytest.mark.parametrize(
    ("emulated", "full"),
    [
        ("bert_large_pod16_emulated", "bert_large_pod16"),
        ("gpt3_175b_pod256_emulated", "gpt3_175b_pod256"),
    ],
)
def test_emulated_keeps_the_topology_and_recipe(emulated, full):
    e, f = preset(emulated), preset(full)
    assert (e.devices, e.mesh.shape, e.model.name) == (f.devices, f.mesh.shape, f.model.name)
    recipe = lambda c: (  # noqa: E731
        c.precision.params,
        c.precision.compute,
        c.precision.master,
        c.precision.loss_scale,
        c.optim.name,
        c.model.remat,
        c.model.norm,
        c.model.sequence_chunks,
    )
    assert recipe(e) == recipe(f)
    assert set(e.memory.offload) == set(f.memory.offload)
    assert (e.memory.rts, e.memory.rts_optimizer) == (f.memory.rts, f.memory.rts_optimizer)
    assert e.memory.stream == f.memory.stream  # the MLP in 2 blocks, not 8: 3 steps in 65 s
    assert (e.memory.vocab_slices > 1) == (f.memory.vocab_slices > 1)


# The TPU companions of the full-size presets and the slice each is compiled for (as
# benchmarks/bench_tpu.py compiles them; docs/targets.md).
TPU_PRESETS = {
    "bert_large_tpu_v5p": "tpu-v5p:2x2x4",
    "gpt3_175b_tpu_v5p": "tpu-v5p:8x8x4",
    "llama3_8b_tpu_v5p": "tpu-v5p:4x4x4",
    "efficientnet_b4_g16_tpu_v5e16": "tpu-v5e:4x4",
    "efficientnet_b4_g16_tpu_v5e256": "tpu-v5e:16x16",
}


@pytest.mark.parametrize(("name", "target"), TPU_PRESETS.items())
def test_a_tpu_preset_is_planned_for_its_slice(name, target):
    """The mesh has the slice's chips, the plan is the slice's TPU profile and fits it, and
    the preset triggers none of the tool's warnings; EfficientNet keeps the seed's global
    batch of 6144 on both slices."""
    from jaxpod.target.spec import parse_target

    cfg, t = preset(name), parse_target(target)
    assert math.prod(cfg.mesh.shape) == cfg.devices == t.chips
    p = plan(cfg)
    assert p["device_profile"] == t.profile and p["fits"]
    assert cfg.precision.params == "bfloat16"  # the TPU's 16-bit type
    assert cfg.warnings() == []
    if cfg.model.name == "efficientnet":
        assert cfg.global_batch == 6144

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


def test_bert_large_pod16_plan():
    """4 stages x 4 replicas: 335 M parameters, a quarter of them per device; fits the GC200
    with the LAMB state in streaming memory, not without it."""
    p = plan(preset("bert_large_pod16"))
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (16, 4, 4, 1)
    assert abs(p["params"] - 335e6) / 335e6 < 0.02
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 4)
    assert p["device_profile"] == "ipu-gc200" and p["device_memory_bytes"] == GC200
    assert p["fits"] and p["bytes_per_device"]["host_total"] > 0
    assert not plan(preset("bert_large_pod16", "memory.offload=[]"))["fits"]


def test_bert_large_pipeline8_fits_model_and_optimizer_on_chip():
    p = plan(preset("bert_large_pod16_pipeline8"))
    b = p["bytes_per_device"]
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (16, 2, 8, 1)
    assert abs(p["params"] - 335e6) / 335e6 < 0.02
    assert p["weight_fraction_per_device"] == pytest.approx(1 / 8)
    assert p["fits"] and p["phases"] == 1 and not p["offload"]
    assert b["optimizer"] > 0 and b["host_total"] == 0 and b["device_total"] <= GC200


def test_gpt3_175b_pod256_plan():
    """175 B parameters on 8 x 8 x 4 devices; 1/(t·p·rts) = 1/256 of the weights per device.
    Streamed matrix by matrix (one 38 MB block gathered at a time, not a 453 MB layer), each
    step fetching its own weights from streaming memory (two steps' blocks on the device,
    not two layers'), the token table used 16 blocks of rows at a time (one 10 MB block
    gathered, not the 155 MB table), it needs 729 MB: it fits a GC200's 900 MB. With the
    table whole it needs 864 MB; layer by layer, 1.48 GB (does not fit)."""
    p = plan(preset("gpt3_175b_pod256"))
    assert (p["devices"], p["replica"], p["pipeline"], p["tensor"]) == (256, 4, 8, 8)
    assert abs(p["params"] - 175e9) / 175e9 < 0.01
    assert p["weight_fraction_per_device"] == pytest.approx(1 / (8 * 8 * 4))
    assert (p["rts"], p["configured_phases"]) == (4, 12)
    assert set(p["offload"]) == {"params", "optimizer", "activations"}
    assert (p["configured_stream"], p["mlp_panels"], p["vocab_slices"]) == ("matrix", 8, 16)
    b = p["bytes_per_device"]
    # on the device: the non-layer weights (token table and positions split over tensor 8,
    # everything over rts 4) and two steps' blocks, the largest step D^2 = 2·D·F/8 params
    d, f, v, t, rts, fp16 = 12288, 49152, 50304, 8, 4, 2
    table = v * d / t
    other = (table + 2048 * d / t + 2 * d) / rts
    step = max(d * d, 2 * d * f / 8) / t / rts
    assert b["weights"] == pytest.approx((other + 2 * step) * fp16, rel=0.01)
    assert b["grads"] == b["weights"]  # the same window, written back to streaming memory
    assert b["device_total"] == pytest.approx(729e6, rel=0.01)
    assert p["fits"] and p["phases"] == 12
    # the table gathered whole instead of a block and its gradient at a time
    whole = plan(preset("gpt3_175b_pod256", "memory.vocab_slices=1"))["bytes_per_device"]
    assert whole["gathered"] - b["gathered"] == pytest.approx((table - 2 * table / 16) * fp16)
    assert whole["device_total"] == pytest.approx(864e6, rel=0.01)
    layer = plan(preset("gpt3_175b_pod256", "memory.stream=layer", "memory.mlp_panels=1"))
    gathered = layer["bytes_per_device"]["gathered"] - b["gathered"]
    assert gathered == pytest.approx(378e6, rel=0.01)
    assert layer["bytes_per_device"]["device_total"] > 1.4e9 and not layer["fits"]
    assert p["host_fits"]  # 6.6 GB of the 64 GB streaming memory
    assert plan(preset("gpt3_175b_pod256", "memory.device=h100-80gb"))["fits"]


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
        c.precision.params, c.precision.compute, c.precision.master, c.precision.loss_scale,
        c.optim.name, c.model.remat, c.model.norm, c.model.sequence_chunks,
    )  # fmt: skip
    assert recipe(e) == recipe(f)
    assert set(e.memory.offload) == set(f.memory.offload)
    assert (e.memory.rts, e.memory.rts_optimizer) == (f.memory.rts, f.memory.rts_optimizer)
    assert e.memory.stream == f.memory.stream  # the MLP in 2 blocks, not 8: 3 steps in 65 s
    assert (e.memory.vocab_slices > 1) == (f.memory.vocab_slices > 1)

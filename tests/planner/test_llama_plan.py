"""The planner on GPT's Llama options: parameter counts equal the built model's (in total and
per device under pipeline and tensor sharding), the FLOP count follows the matmul weights,
and the estimate's workload carries the options (analytic, instant); the Llama-3-8B
preset's count is Llama's plus the biases and LayerNorm shifts it keeps."""

from __future__ import annotations

import math

import jax
import pytest
from helpers import model_params_and_specs

from jaxpod.config import load_config
from jaxpod.inspect.estimate import estimate_config, workload_of
from jaxpod.planner.counts import flops_per_example, layer_matmul_params, param_layout

OPTIONS = {
    "gqa": ["model.kv_heads=2"],
    "mqa": ["model.kv_heads=1"],
    "swiglu": ["model.mlp=swiglu"],
    "rope": ["model.positions=rope"],
    "llama-untied": [
        "model.kv_heads=2",
        "model.mlp=swiglu",
        "model.positions=rope",
        "model.tie_embeddings=false",
    ],
    "llama-sp": [
        "model.kv_heads=2",
        "model.mlp=swiglu",
        "model.positions=rope",
        "model.sequence_parallel=true",
    ],
}


def cfg_of(*overrides: str, tensor: int = 1):
    mesh = [f"devices={2 * tensor}", "mesh.pipeline=2", f"mesh.tensor={tensor}"]
    return load_config(None, [*mesh, "model.heads=8", "model.layers=4", *overrides])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_param_layout_matches_the_model(name):
    """Total parameters equal the model's own count (eval_shape, no weights); on pipeline 2 x
    tensor 2 (kv_heads 1 cannot split: tensor 1) the per-device count equals what the
    model's partition specs leave on one device."""
    tensor = 1 if name == "mqa" else 2
    cfg = cfg_of(*OPTIONS[name], tensor=tensor)
    params, specs = model_params_and_specs(cfg)
    layout = param_layout(cfg)
    assert layout["total"] == sum(x.size for x in jax.tree.leaves(params))
    sizes = {"pipeline": 2, "tensor": tensor}
    split = lambda spec: math.prod(sizes.get(a, 1) for e in spec if e for a in jax.tree.leaves(e))
    held = jax.tree.map(lambda x, s: x.size // split(s), params, specs)
    assert layout["local"] == sum(jax.tree.leaves(held))


def test_matmul_flops_count_the_weights_a_token_meets():
    """Forward FLOPs per token: 2 x the layers' weight matrices (no biases or norms) + the
    token table + attention's 4·T·D per layer; GQA's narrower keys and values and SwiGLU's
    third matrix are in the matrices."""
    cfg = cfg_of(*OPTIONS["llama-untied"])
    params, _ = model_params_and_specs(cfg)
    layer = params["layers"]
    weights = sum(layer[m][w].size for m, w in [("attn", "w_qkv"), ("attn", "w_o")])
    weights += sum(layer["mlp"][w].size for w in ("w_in", "w_out"))
    md = cfg.model
    assert md.layers * layer_matmul_params(md) == weights
    want = 2 * (weights + md.vocab * md.d_model) + 4 * md.layers * md.seq_len * md.d_model
    assert flops_per_example(cfg) == want


def test_the_estimate_sees_the_options():
    """The step-time model's workload has the config's KV heads and the gated MLP."""
    w = workload_of(cfg_of(*OPTIONS["llama-sp"], tensor=2))
    assert (w.kv_heads, w.gated) == (2, True)
    w = workload_of(cfg_of(tensor=2))
    assert (w.kv_heads, w.gated) == (8, False)


def test_the_estimate_reports_the_models_parameters():
    """`estimate` prints the config's own parameter count (untied tables, biases, norms)."""
    cfg = cfg_of(*OPTIONS["llama-untied"], tensor=2)
    assert estimate_config(cfg, "tpu-v5p")["params"] == param_layout(cfg)["total"]


def test_llama3_8b_preset_counts_llamas_parameters_and_what_it_adds():
    """Llama-3-8B has 8,030,261,248 parameters; jaxpod's GPT adds per layer the biases of
    W_qkv (4096 + 2·1024), W_o (4096), W_in (2·14336), W_out (4096) and the two LayerNorm
    shifts (2·4096), and the final LayerNorm's shift (4096)."""
    from helpers import CONFIGS

    cfg = load_config(CONFIGS / "llama3_8b_tpu_v5p.yaml", [])
    added = 32 * (6144 + 4096 + 28672 + 4096 + 8192) + 4096
    assert param_layout(cfg)["total"] == 8_030_261_248 + added


def test_llama3_8b_preset_estimates_on_its_slice():
    """`estimate` on the preset's slice, named as `compile --target` names it: 64 v5p chips,
    the preset's mapping, a step time and an MFU between 0 and 1."""
    from helpers import CONFIGS

    from jaxpod.inspect.estimate import parse_estimate_target

    cfg = load_config(CONFIGS / "llama3_8b_tpu_v5p.yaml", [])
    profile, chips = parse_estimate_target("tpu-v5p:4x4x4")
    assert (profile, chips) == ("tpu-v5p", cfg.devices)
    r = estimate_config(cfg, profile)
    assert r["target"] == "tpu-v5p:64" and r["global_batch"] == 128
    assert r["step_time_s"] > 0 and 0 < r["mfu"] < 1

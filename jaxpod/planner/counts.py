"""Analytic parameter counts and where they live per device, for the planner.

Transformers (gpt, bert) are counted from their formulas, EfficientNet stages from their block
specs (`efficientnet_specs.stage_params`); both are checked against the real models in tests.
Nothing here imports jax.
"""

from __future__ import annotations

import math

from jaxpod.config import Config, ModelConfig
from jaxpod.config.efficientnet_specs import flops_per_image, shape_options, stage_params


def efficientnet_stage_params(cfg: Config) -> list[int]:
    """Exact parameter count of each pipeline stage of an EfficientNet config, from its
    block specs (no modules are built)."""
    md = cfg.model
    return stage_params(
        md.variant,
        splits=md.pipeline_splits,
        num_classes=md.num_classes,
        **shape_options(md),
    )


def layer_params(md: ModelConfig) -> tuple[int, int]:
    """(tensor-sharded, replicated) parameter counts of one transformer layer of `md`: the
    attention's `W_qkv[D, D + 2·KVD]` (KVD = kv_heads · head width: GQA's narrower keys and
    values) and `W_o`, the MLP's input (two of width F with SwiGLU) and output."""
    d, f = md.d_model, md.d_ff
    qkv = d + 2 * md.kv_head_count * (d // md.heads)  # query, key and value widths
    f_in = 2 * f if md.mlp == "swiglu" else f  # SwiGLU: gate and up
    sharded = d * qkv + qkv + d * d + d * f_in + f_in + f * d  # qkv, W_o, MLP weights/in-bias
    replicated = 4 * d + d + d  # two LNs, W_o bias, MLP out bias
    return sharded, replicated


def layer_matmul_params(md: ModelConfig) -> int:
    """Weights of one transformer layer that a token multiplies by (no biases or norms)."""
    sharded, _ = layer_params(md)
    qkv = md.d_model + 2 * md.kv_head_count * (md.d_model // md.heads)
    return sharded - qkv - (2 * md.d_ff if md.mlp == "swiglu" else md.d_ff)


def param_layout(cfg: Config, params_override: int | None = None) -> dict:
    """Parameter counts: `total`, `layers` (all layers), and per device before RTS:
    `local` = `local_layers` (this stage's layers) + `local_other` (embeddings, head)."""
    md, t, p = cfg.model, cfg.mesh.tensor, cfg.mesh.pipeline
    if md.name == "efficientnet":
        stages = [params_override] if params_override else efficientnet_stage_params(cfg)
        total = sum(stages)
        local = max(stages) if len(stages) == p else math.ceil(total / p)
        return {
            "total": total,
            "layers": total,
            "local": local,  # the largest stage: its row sets every stage's buffer size
            "local_layers": local,
            "local_other": 0,
            "estimated": False,
        }
    d, v, s = md.d_model, md.vocab, md.seq_len
    sharded, replicated = layer_params(md)
    vocab_sharded = v * d  # token embedding (vocab-parallel)
    other_replicated = 2 * d  # final (gpt) / embedding (bert) LN
    positions = 0 if md.positions == "rope" else s * d  # RoPE: no table
    if md.sequence_parallel:  # positions split over tensor along T
        vocab_sharded += positions
    else:
        other_replicated += positions
    if md.name == "gpt" and not md.tie_embeddings:
        vocab_sharded += v * d
    if md.name == "bert":
        vocab_sharded += v  # MLM output bias
        other_replicated += 2 * d + d * d + d + 2 * d  # token types, head dense, head LN
    layers_total = md.layers * (sharded + replicated)
    total = layers_total + vocab_sharded + other_replicated
    if params_override is not None:
        total = params_override
    local_layers = md.layers // p * (sharded // t + replicated)
    local_other = vocab_sharded // t + other_replicated
    return {
        "total": total,
        "layers": layers_total,
        "local": local_layers + local_other,
        "local_layers": local_layers,
        "local_other": local_other,
        "estimated": False,
    }


def flops_per_example(cfg: Config) -> int:
    """Forward FLOPs (2 x multiply-adds) per image (EfficientNet, exact layer by layer) or per
    token (transformers: 2 x weight-matmul parameters + 4 x layers x seq x d_model attention)."""
    md = cfg.model
    if md.name == "efficientnet":
        return flops_per_image(
            md.variant,
            md.image_size,
            md.num_classes,
            **shape_options(md),
        )
    matmul = md.layers * layer_matmul_params(md) + md.vocab * md.d_model
    return 2 * matmul + 4 * md.layers * md.seq_len * md.d_model

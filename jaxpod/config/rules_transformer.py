"""Transformer shapes against the mesh, and the GPT family's options: grouped-query
attention (`model.kv_heads`), the gated MLP (`model.mlp`) and rotary positions
(`model.positions`, `model.rope_base`).

Called by `jaxpod.config.rules.check_model` for stacked (transformer) models; imports
`fields` and `schema` only (no jax).
"""

from jaxpod.config.fields import fail
from jaxpod.config.schema import Config, ModelConfig

DEFAULTS = ModelConfig()


def check_transformer(cfg: Config) -> None:
    """`mesh.tensor` divides the heads, MLP units and vocabulary of a tensor-parallel model;
    `kv_heads` divides `heads` and splits over `mesh.tensor` (each tensor shard holds whole
    KV heads with their query heads, as Megatron does); the head width is even for RoPE;
    the options are GPT's."""
    md, t = cfg.model, cfg.mesh.tensor
    for name in ("heads", "d_ff", "vocab") if cfg.kind.tensor_parallel else ():
        if getattr(md, name) % t:
            fail(
                f"mesh.tensor={t} does not divide model.{name}={getattr(md, name)}; "
                f"use a mesh.tensor that divides it or a multiple of {t}"
            )
    if md.name != "gpt":
        for key in ("kv_heads", "mlp", "positions"):
            if getattr(md, key) != getattr(DEFAULTS, key):
                default = "null" if key == "kv_heads" else getattr(DEFAULTS, key)
                fail(
                    f"model.{key}={getattr(md, key)} is a GPT option; "
                    f"set model.{key}={default} for model.name={md.name}"
                )
    kv = md.kv_head_count
    if md.heads % kv:
        fail(
            f"model.kv_heads={kv} does not divide model.heads={md.heads}; "
            f"choose a divisor of {md.heads} (each KV head serves heads/kv_heads query heads)"
        )
    if kv % t:
        fail(
            f"mesh.tensor={t} does not divide model.kv_heads={kv}; each tensor shard holds "
            f"whole KV heads: use a mesh.tensor that divides {kv} or more model.kv_heads"
        )
    if md.positions == "rope":
        if (md.d_model // md.heads) % 2:
            fail(
                f"model.positions=rope rotates pairs of a head's {md.d_model // md.heads} "
                "dimensions (model.d_model/model.heads), which must be even"
            )
        if not md.rope_base > 1:
            fail(f"model.rope_base={md.rope_base:g} must be > 1, e.g. model.rope_base=10000")

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
    """The options are GPT's, and RoPE's head width is even. How heads and KV heads split
    over `mesh.tensor` (each shard holds whole KV heads with their query heads, as Megatron
    does) is in the divisibility table (`jaxpod.config.divisibility`)."""
    md = cfg.model
    if md.name != "gpt":
        for key in ("kv_heads", "mlp", "positions"):
            if getattr(md, key) != getattr(DEFAULTS, key):
                default = "null" if key == "kv_heads" else getattr(DEFAULTS, key)
                fail(
                    f"model.{key}={getattr(md, key)} is a GPT option; "
                    f"set model.{key}={default} for model.name={md.name}"
                )
    if md.positions == "rope":
        if (md.d_model // md.heads) % 2:
            fail(
                f"model.positions=rope rotates pairs of a head's {md.d_model // md.heads} "
                "dimensions (model.d_model/model.heads), which must be even"
            )
        if not md.rope_base > 1:
            fail(f"model.rope_base={md.rope_base:g} must be > 1, e.g. model.rope_base=10000")

"""The GPT family's attention, MLP and position options are refused, in one line naming the
field and the fix, where the model or the mesh cannot hold them."""

from __future__ import annotations

import pytest
from helpers import make_tiny_cfg

from jaxpod.config import ConfigError


@pytest.mark.parametrize(
    ("overrides", "mesh", "message"),
    [
        (("model.kv_heads=3",), (1, 1, 1), "model.kv_heads=3 does not divide model.heads=4"),
        (("model.kv_heads=0",), (1, 1, 1), "model.kv_heads=0 must be >= 1"),
        (("model.kv_heads=1",), (1, 1, 2), "mesh.tensor=2 does not divide model.kv_heads=1"),
        (("model.kv_heads=2",), (1, 1, 4), "mesh.tensor=4 does not divide model.kv_heads=2"),
        (("model.mlp=geglu",), (1, 1, 1), "model.mlp='geglu' is not one of gelu, swiglu"),
        (
            ("model.positions=rope", "model.heads=64"),
            (1, 1, 1),
            "model.positions=rope rotates pairs of a head's 1 dimensions",
        ),
        (("model.positions=rope", "model.rope_base=1"), (1, 1, 1), "model.rope_base=1 must be"),
        (
            ("model.name=bert", "model.vocab=264", "model.mlp=swiglu"),
            (1, 1, 1),
            "model.mlp=swiglu is a GPT option; set model.mlp=gelu for model.name=bert",
        ),
        (
            ("model.name=bert", "model.vocab=264", "model.kv_heads=2"),
            (1, 1, 1),
            "model.kv_heads=2 is a GPT option; set model.kv_heads=null",
        ),
    ],
    ids=[
        "kv-3",
        "kv-0",
        "tensor-2-kv-1",
        "tensor-4-kv-2",
        "mlp",
        "rope-odd",
        "rope-base",
        "bert-mlp",
        "bert-kv",
    ],
)
def test_options_the_model_cannot_hold_are_one_line(overrides, mesh, message):
    with pytest.raises(ConfigError, match=message.replace("'", ".").replace("(", ".")) as err:
        make_tiny_cfg(*overrides, mesh=mesh)
    assert "\n" not in str(err.value)


def test_options_that_fit_load():
    """kv_heads = heads is multi-head attention; 2 KV heads split over 2 tensor shards."""
    cfg = make_tiny_cfg(
        "model.kv_heads=2", "model.mlp=swiglu", "model.positions=rope", mesh=(1, 1, 2)
    )
    assert (cfg.model.kv_head_count, cfg.model.mlp, cfg.model.positions) == (2, "swiglu", "rope")
    assert make_tiny_cfg(mesh=(1, 1, 2)).model.kv_head_count == 4

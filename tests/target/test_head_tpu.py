"""A 16-bit loss head in XLA:TPU's compiled steps (libtpu, no TPU attached; bfloat16 compute):
at no moment does the step hold more logits-shaped values [rows, V/t] than one float32 and
one bfloat16 copy, the planner's head (`jaxpod.planner.activations.rounded_head`), where
XLA:CPU's program holds two float32 ones. The BERT-Large v5p preset's mapping at d 512
(8 layers, GPipe over 4 stages, a vocabulary of 30,528, 4,096 head rows) holds exactly
both; GPipe probes of the base GPT and BERT (v5p 2x2x1) hold one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, tpu_mesh

from jaxpod.config import load_config
from jaxpod.planner.activations import activation_bytes
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.slow

PROFILE = get_profile("tpu-v5p")
PRESET = Path(__file__).parents[2] / "configs" / "bert_large_tpu_v5p.yaml"
SMALL = ("model.layers=8", "model.d_model=512", "model.heads=8", "model.d_ff=2048")
GPIPE = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
GPIPE += ("model.vocab=8192", "model.layers=8", "train.grad_accum=4", "model.remat=full")
GPIPE += ("precision.compute=bfloat16", "train.pipeline_schedule=gpipe")


def _most_logits(cfg, mesh: tuple, target: str) -> tuple[int, int]:
    """`(bytes, rows)`: the most bytes of [rows, V/t] values alive at one moment of `cfg`'s
    compiled step, and their rows."""
    _, _, (values, ranges, _) = dumped_step(cfg, tpu_mesh(mesh, target))
    vocab = cfg.model.vocab // cfg.mesh.tensor
    dims = {v: dims_of(values[v][2]) for v in ranges}
    logits = {v: values[v][0] for v in ranges if len(dims[v]) == 2 and dims[v][1] == vocab}
    ends = sorted({b for _, b in ranges.values()})
    most = max(sum(n for v, n in logits.items() if ranges[v][0] <= t <= ranges[v][1]) for t in ends)
    return most, max(dims[v][0] for v in logits)


def _planned_logits(cfg, rows: int) -> int:
    """The planner's logits bytes over `rows` head rows: its head less the final norm's
    rows (BERT's nine, GPT's four, bfloat16)."""
    norm_rows = 9 if cfg.model.name == "bert" else 4
    return activation_bytes(cfg, PROFILE)["head"] - rows * cfg.model.d_model * 2 * norm_rows


def test_the_preset_mapping_holds_one_float32_and_one_bfloat16_logits():
    """Both copies at once, the planner's head to the byte."""
    cfg = load_config(PRESET, [*SMALL, "devices=16"])
    most, rows = _most_logits(cfg, (4, 4, 1), "tpu-v5p:2x2x4")
    assert most == _planned_logits(cfg, rows) == rows * 30528 * (4 + 2)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_gpipe_probes_hold_no_more(model):
    """At most the planner's logits (one float32 copy, here)."""
    cfg = make_tiny_cfg(*GPIPE, f"model.name={model}", mesh=(1, 4, 1))
    most, rows = _most_logits(cfg, (1, 4, 1), "tpu-v5p:2x2x1")
    assert 0 < most <= _planned_logits(cfg, rows) == rows * 8192 * (4 + 2)

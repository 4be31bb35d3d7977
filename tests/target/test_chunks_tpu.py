"""Sequence chunks in XLA:TPU's compiled steps (libtpu, no TPU attached; remat full,
bfloat16 compute): a chunk's attention backward holds at most three values of the chunk's
score shape [b, H/t, T/C, T] at once, in the compute dtype, where XLA:CPU's holds five and
a mask (the planner's `_backward_work` per `fuses_recomputation`), and the plan is within
10 % of XLA:TPU's HBM total. The probes: the base GPT at 1,024 positions in 4 chunks (v5p
2x2x1) and the Llama-3-8B v5p preset's mapping at d 1024, 2 layers, 2,048 positions in 8
chunks (GQA, SwiGLU, sequence parallelism, RTS 2, v5p 2x2x2).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers.dumps import dims_of, dumped_program, tpu_mesh

from jaxpod.config import load_config
from jaxpod.planner.backend import backend_plan
from jaxpod.target.buffers import device_memory_bytes
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[2] / "configs"
GPT = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=1024")
GPT += ("model.vocab=8192", "train.grad_accum=2", "model.remat=full", "model.sequence_chunks=4")
GPT += ("precision.compute=bfloat16", "mesh.replica=4", "mesh.pipeline=1", "mesh.tensor=1")
LLAMA = ("mesh.replica=2", "mesh.tensor=4", "model.layers=2", "model.d_model=1024")
LLAMA += ("model.heads=16", "model.kv_heads=4", "model.d_ff=3584", "model.seq_len=2048")
LLAMA += ("model.vocab=16384", "train.micro_batch=2", "memory.rts=2", "memory.rts_optimizer=2")
LLAMA += ("memory.vocab_slices=2",)
PROBES = {
    "gpt": ("tiny.yaml", GPT, "tpu-v5p:2x2x1"),
    "llama": ("llama3_8b_tpu_v5p.yaml", LLAMA, "tpu-v5p:2x2x2"),
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_chunk_holds_at_most_three_score_values(name):
    base, overrides, target = PROBES[name]
    chips = math.prod(int(n) for n in target.split(":")[1].split("x"))
    cfg = load_config(CONFIGS / base, [*overrides, f"devices={chips}"])
    mesh = (cfg.mesh.replica, cfg.mesh.pipeline, cfg.mesh.tensor)
    program = dumped_program(cfg, tpu_mesh(mesh, target), device_only=True)
    values, ranges, _ = program.live
    md, b = cfg.model, cfg.train.micro_batch
    rows = md.seq_len // md.sequence_chunks
    scalars = b * md.heads // cfg.mesh.tensor * rows * md.seq_len
    scores = {
        v: r
        for v, r in ranges.items()
        if math.prod(dims := dims_of(values[v][2])) == scalars
        and md.seq_len in dims
        and rows in dims
    }
    assert scores, "no value of a chunk's score shape"
    most = max(covered(values, scores, t) for t in sorted({b for _, b in scores.values()}))
    assert most <= 3 * 2 * scalars, (most, scalars)
    planned = backend_plan(cfg, target.split(":")[0])["device_total"]
    assert 0.9 < planned / device_memory_bytes(program.spaces) < 1.1

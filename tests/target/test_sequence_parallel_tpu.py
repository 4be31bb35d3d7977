"""Sequence parallelism in XLA:TPU's compiled steps (libtpu, no TPU attached; a v5p 2x2x1
slice, tensor 4, bfloat16 compute), against the TPU profile's two terms for it:

- `fuses_recomputation`: a recomputed layer's backward holds whole-sequence rows
  [b, T, D] (the all-gathered inputs, the row-parallel outputs before their reduce-scatter)
  and no [b, T/t, D] row; the planner's fused working set counts its residual rows whole
  (`jaxpod.planner.layer._fused_work`), nearer XLA's than [b, T/t, D] rows would be;
- `head_grads_at_once`: with sequence parallelism no value of the logits' shape waits
  through the layers' backward, GPT's or BERT's, in bfloat16 too, and of the head's rows at
  most one; the planner keeps nothing of the head there (`_head_kept`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_step, tpu_mesh

from jaxpod.planner.activations import activation_bytes, compute_bytes
from jaxpod.planner.profiles import get_profile

pytestmark = pytest.mark.slow

TARGET, PROFILE = "tpu-v5p:2x2x1", get_profile("tpu-v5p")
SHAPE = ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
SHAPE += ("model.vocab=8192", "train.grad_accum=2", "memory.device=tpu-v5p")
SP = (*SHAPE, "model.sequence_parallel=true", "precision.compute=bfloat16")
PROBES = {  # name: overrides, on a (1, 1, 4) mesh
    "gpt-attention": (*SP, "model.remat=attention"),
    "bert-full": (*SP, "model.name=bert", "model.remat=full"),
}


@pytest.fixture(scope="module", params=sorted(PROBES))
def probe(request):
    """`(cfg, (values, ranges, schedule))` of one probe's compiled step."""
    cfg = make_tiny_cfg(*PROBES[request.param], mesh=(1, 1, 4))
    _, _, live = dumped_step(cfg, tpu_mesh((1, 1, 4), TARGET))
    return cfg, live


def _layer_peak(cfg, values: dict, ranges: dict, schedule: dict) -> tuple[int, int]:
    """`(bytes, position)`: the most the micro-batch-shaped temporaries ([b, ...], rank 3 or
    more) alive for under an eighth of the schedule (one layer's values) cover at once."""
    from jaxpod.target.live_ranges import covered

    b, steps = cfg.train.micro_batch, max(schedule) + 1

    def layer_value(name: str) -> bool:
        dims, (first, last) = dims_of(values[name][2]), ranges[name]
        return len(dims) >= 3 and dims[:1] == (b,) and last - first < steps // 8

    layer = {name: r for name, r in ranges.items() if layer_value(name)}
    return max((covered(values, layer, t), t) for t in range(steps))


def _alive(values: dict, ranges: dict, t: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(v, dims_of(values[v][2])) for v, (a, b) in ranges.items() if a <= t <= b]


def test_a_recomputed_layer_holds_whole_sequence_rows(probe):
    """At a recomputed layer's backward peak three or more [b, T, D] rows are alive and no
    [b, T/t, D] one; the layer's values cover the planner's fused working set within
    `cb + 4` bytes a [b, T, D] row, nearer than with its rows counted [b, T/t, D]."""
    cfg, (values, ranges, schedule) = probe
    md, t = cfg.model, cfg.mesh.tensor
    b, s, d = cfg.train.micro_batch, md.seq_len, md.d_model
    held, peak = _layer_peak(cfg, values, ranges, schedule)
    shapes = [dims for _, dims in _alive(values, ranges, peak)]
    assert shapes.count((b, s, d)) >= 3 and (b, s // t, d) not in shapes, shapes
    cb, row = compute_bytes(cfg, PROFILE), b * s * d
    planned = activation_bytes(cfg, PROFILE)["layer_work"]
    assert abs(held - planned) <= (cb + 4) * row, (held, planned)
    sharded_rows = planned - (3 * cb + 2) * (row - row // t)  # the rows as [b, T/t, D]
    assert abs(held - planned) < abs(held - sharded_rows), (held, planned, sharded_rows)


def test_the_head_keeps_no_logits_through_the_layers_backward(probe):
    """At the layers' backward peak no value of the logits' shape ([b·T, V/t], [b, T, V/t],
    or over T/t positions) outlives a layer (an eighth of the schedule), and of the head's
    rows ([b·T, D], [b, T, D]) at most one float32 row's bytes: the planner keeps nothing
    of the head (`head_grads_at_once`), where the CPU-read term keeps the logits' cotangent."""
    cfg, (values, ranges, schedule) = probe
    md, t = cfg.model, cfg.mesh.tensor
    b, s, v, steps = cfg.train.micro_batch, md.seq_len, md.vocab // t, max(schedule) + 1
    logits = {(b * s, v), (b, s, v), (b * s // t, v), (b, s // t, v)}
    d = md.d_model  # rows [b·T, D] of D positions are not told from BERT's [D, D] weight
    rows = {(b * s, d), (b, s, d)} - {(d, d)}
    _, peak = _layer_peak(cfg, values, ranges, schedule)
    kept = [
        (name, dims)
        for name, dims in _alive(values, ranges, peak)
        if ranges[name][1] - ranges[name][0] >= steps // 8
    ]
    assert not [name for name, dims in kept if dims in logits], kept
    assert sum(values[name][0] for name, dims in kept if dims in rows) <= 4 * b * s * d
    assert activation_bytes(cfg, PROFILE)["head_kept"] == 0
    cpu_term = activation_bytes(cfg, replace(PROFILE, head_grads_at_once=False))["head_kept"]
    assert cpu_term >= b * s * v * 4

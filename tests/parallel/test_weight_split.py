"""B and W split a layer's backward (`jaxpod.parallel.weight_split`), and where B keeps what
W needs (`weight_slots`).

A GPT and a BERT layer: B's input gradient and W's parameter gradients, from B's saved
operands and probe cotangents, against `jax.vjp` of the plain layer; a stage of two layers
under remat `full` (`StageSplit`) against `jax.vjp` of the plain layer scan. The slot
tables of ZB-H1 and ZB-V: a slot holds one (micro-batch, chunk) from its B to its W, and no
more slots than the most B-done, W-pending chunks a stage holds.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import make_tiny_cfg

from jaxpod.models.family import build_model
from jaxpod.parallel.layer_scan import scan_layers
from jaxpod.parallel.remat import remat
from jaxpod.parallel.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, make_schedule
from jaxpod.parallel.schedules_split import weight_slots
from jaxpod.parallel.weight_split import LayerSplit, StageSplit

RTOL = 1e-6  # the same operations, summed in the same order


def _layer(model: str):
    """(layer(x, p), stacked params [2, ...], x[1, 32, D], cotangent like x), seeded."""
    cfg = make_tiny_cfg(
        "model.layers=2", "model.seq_len=32", f"model.name={model}", "model.vocab=264"
    )
    graphdef, state = nnx.split(build_model(cfg.model, 0).layers)
    layer = lambda x, p: nnx.merge(graphdef, p)(x, None)  # noqa: E731
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (1, 32, cfg.model.d_model))
    return layer, nnx.to_pure_dict(state), x, jax.random.normal(keys[1], x.shape)


def _close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * float(np.abs(w).max()))


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_b_then_w_give_the_layers_gradients(model):
    layer, stacked, x, ct = _layer(model)
    p = jax.tree.map(lambda a: a[0], stacked)
    split = LayerSplit(layer, x, p)
    assert split.uses and split.saved  # the matmuls and norms meet the data
    _, vjp, saved = jax.vjp(
        lambda x, z: split.probed(x, p, z), x, split.probe_zeros(), has_aux=True
    )
    dx, cts = vjp(ct)
    want_dx, want_dp = jax.vjp(layer, x, p)[1](ct)
    _close(dx, want_dx)
    _close(split.weight_grads(p, saved, cts), want_dp)


def test_a_stage_under_remat_full():
    layer, stacked, x, ct = _layer("gpt")
    stage = StageSplit(layer, lambda p, r=0: p, lambda fn: remat(fn, "full"), unroll=False)
    stage.prepare(stacked, x)
    fn = lambda x, z: stage.forward(stacked, x, z)  # noqa: E731
    _, vjp, saved = jax.vjp(fn, x, stage.probes(), has_aux=True)
    dx, cts = vjp(ct)
    plain = lambda x, p: scan_layers(remat(layer, "full"), x, p)  # noqa: E731
    want_dx, want_dp = jax.vjp(plain, x, stacked)[1](ct)
    _close(dx, want_dx)
    _close(stage.weights(stacked, saved, cts), want_dp)


@pytest.mark.parametrize("kind, virtual", [("zb-h1", 1), ("zb-v", 2)])
@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 4), (4, 8)])
def test_weight_slots_hold_one_chunk_from_b_to_w(kind, virtual, stages, micro):
    table = make_schedule(kind, stages, micro, virtual)
    slot, count = weight_slots(table)
    for s in range(stages):
        holder: dict[int, tuple] = {}
        for t, op, m, r in table.ops(s):
            if op == BACKWARD_INPUT:
                assert slot[t, s] not in holder and 0 <= slot[t, s] < count
                holder[slot[t, s]] = (m, r)
            elif op == BACKWARD_WEIGHT:
                assert holder.pop(slot[t, s]) == (m, r)
        assert not holder
    most = max(_pending(table, s) for s in range(stages))
    assert count == max(most, 1)  # no more slots than chunks held


def _pending(table, s: int) -> int:
    """The most chunks stage s holds between their B and their W."""
    held = most = 0
    for _, op, _, _ in table.ops(s):
        held += int(op == BACKWARD_INPUT) - int(op == BACKWARD_WEIGHT)
        most = max(most, held)
    return most

"""A batch fed in parts (`train.batch_parts`) trains like the whole batch in one call.

One optimizer step of `run_step` on k parts against one `train_step` on the whole batch, the
same data and init: the summed loss, the accuracy and every updated parameter agree (the
same sums, associated per part; each device sums its parts' gradients unreduced and the
replicas reduce them once, in the last part's call). Cases:
the tiny GPT unpipelined (micro-batches accumulated in a scan within a call) and on 2x2x1
(1F1B, replicas), the tiny EfficientNet's packed stages on 4x2x1 (GPipe: helpers'
`TINY_VISION`).
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from helpers import TINY_VISION, grouped_cases

from jaxpod.engine import build_engine

LOSS_RTOL = 1e-6
PARAM_ATOL = 1e-7  # one SGD step of ~1e-3 (as test_schedules_engine.py)
LARS_ATOL = 2e-7  # one LARS step: the trust ratio divides the summed gradient's norm
GPT = ("train.global_batch=16", "train.grad_accum=null", "optim.warmup_steps=0")
GPT += ("optim.name=sgd", "optim.grad_clip=0", "model.layers=4", "model.seq_len=32")
CASES = {
    "gpt-1x1x1-parts4": (GPT, (1, 1, 1), 4),
    "gpt-2x2x1-1f1b-parts2": ((*GPT, "train.pipeline_schedule=1f1b"), (2, 2, 1), 2),
    "effnet-4x2x1-parts2": (TINY_VISION, (4, 2, 1), 2),
}


def _batch(cfg) -> tuple:
    """The whole step's batch as host arrays, the same for every `batch_parts`."""
    g = cfg.global_batch
    if cfg.kind.data == "images":
        from jaxpod.data.images import load_images

        digits = load_images("digits", image_size=cfg.model.image_size, seed=0)
        return digits.train_batch(0, 0, g, g)
    rng = np.random.default_rng(3)
    return (rng.integers(0, 256, (g, cfg.model.seq_len + 1), np.int32),)


def _step(tiny_cfg, mesh_for, overrides, mesh, parts):
    cfg = tiny_cfg(*overrides, f"train.batch_parts={parts}", mesh=mesh)
    engine, state = build_engine(cfg, mesh_for(cfg))
    whole, n = _batch(cfg), cfg.part_batch
    batches = [
        jax.device_put(tuple(a[i * n : (i + 1) * n] for a in whole), engine.batch_sharding)
        for i in range(parts)
    ]
    init = jax.device_get(state.params)
    state, metrics = engine.run_step(state, batches)
    return init, jax.device_get((state.params, metrics))


@pytest.mark.parametrize("case", grouped_cases(CASES))
def test_parts_train_like_the_whole_batch(tiny_cfg, mesh_for, case):
    overrides, mesh, parts = CASES[case]
    init, (params, metrics) = _step(tiny_cfg, mesh_for, overrides, mesh, parts)
    _, (want_params, want) = _step(tiny_cfg, mesh_for, overrides, mesh, 1)
    assert abs(metrics["loss"] - want["loss"]) <= LOSS_RTOL * abs(want["loss"])
    if "accuracy" in want:
        assert metrics["accuracy"] == pytest.approx(want["accuracy"], abs=1e-7)
    # measured: equal, equal and 6.1e-8 relative apart
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=LOSS_RTOL)
    atol = LARS_ATOL if case.startswith("effnet") else PARAM_ATOL
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(init), strict=True)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in leaves)
    assert moved > 100 * atol  # the step moved the parameters far more than the tolerance


# The slack of a call that does not update over the one that does: its loss and metric
# scalars (measured 128 to 256 bytes on these cases).
SCALARS = 1024


@pytest.mark.parametrize("case", grouped_cases(["gpt-1x1x1-parts4", "effnet-4x2x1-parts2"]))
def test_the_updating_call_holds_the_most(tiny_cfg, mesh_for, case):
    """`jaxpod compile` (and the planner's comparison) reads the call that updates: the first
    call holds less (no summed gradients in, no update), a middle call no more than it but
    for its scalars (the same arguments, no update). Read from the default compile, whose
    memory analysis is `compile_to_inspect`'s (tests/inspect/test_compile_to_inspect.py): these
    are the programs `test_parts_train_like_the_whole_batch` ran, served by the cache."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.run.mapping import most_on_one_device

    overrides, mesh, parts = CASES[case]
    cfg = tiny_cfg(*overrides, f"train.batch_parts={parts}", mesh=mesh)
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    args = engine.updating_arguments(state, batch)
    calls = {"first": (engine.first_part_step, (state, batch)), "last": (engine.train_step, args)}
    if parts > 2:
        calls["middle"] = (engine.accumulate_step, args)
    held = {}
    for name, (fn, call_args) in calls.items():
        temps = fn.lower(*call_args).compile().memory_analysis().temp_size_in_bytes
        held[name] = most_on_one_device(call_args) + temps
    print(case, held)
    assert held["first"] < held["last"]
    if "middle" in held:
        assert held["first"] < held["middle"] <= held["last"] + SCALARS


# lowered StableHLO: `"stablehlo.all_reduce"(%x) <{..., replica_groups = dense<[[0, 2], [1, 3]]>
# ...}> ({...}) : (tensor<2x64xf32>) -> ...`
ALL_REDUCE = re.compile(
    r'"stablehlo\.all_reduce"\(.*?replica_groups = dense<(\[\[[\d, \[\]]*\]\])>.*?\}\) : '
    r"\(([^)]*)\) ->",
    re.S,
)


def _all_reduces(lowered) -> list[tuple[str, str]]:
    """(groups, operand types) of the all-reduces among more than one device."""
    found = ALL_REDUCE.findall(lowered.as_text())
    return [(groups, types) for groups, types in found if len(json.loads(groups)[0]) > 1]


def test_the_replicas_reduce_the_gradients_once_a_step(tiny_cfg, mesh_for):
    """On 2x2x1 in 4 parts, the first and middle calls all-reduce only the loss (a scalar);
    the last call reduces exactly the gradients one whole-batch call reduces."""
    from jaxpod.inspect.compile import abstract_inputs

    cfg = tiny_cfg(*GPT, "train.batch_parts=4", mesh=(2, 2, 1))
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    args = engine.updating_arguments(state, batch)
    whole_cfg = tiny_cfg(*GPT, mesh=(2, 2, 1))
    whole, whole_state, whole_batch = abstract_inputs(whole_cfg, mesh_for(whole_cfg))
    want = _all_reduces(whole.train_step.lower(whole_state, whole_batch))
    assert len([t for _, t in want if t != "tensor<f32>"]) >= 10  # the gradients
    loss_only = [("[[0, 1, 2, 3]]", "tensor<f32>")]
    assert _all_reduces(engine.first_part_step.lower(state, batch)) == loss_only
    assert _all_reduces(engine.accumulate_step.lower(*args)) == loss_only
    assert _all_reduces(engine.train_step.lower(*args)) == want

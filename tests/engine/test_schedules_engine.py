"""Every pipeline schedule trains GPT, BERT and EfficientNet like the plain model.

GPT and BERT: loss and every gradient against the model's own `__call__` on the whole
global batch (8 sequences in every case: one reference per model) on one device. The engine
runs `train.pipeline_schedule` circular (2 virtual stages, the layers stored round-robin:
`StackedStages.layer_order`) and 1f1b, each on three meshes with M = S, 2S and 4S
micro-batches per replica (`CASES` and the train step: replica > 1, tensor 2 and 4,
pipeline depth 2 and 4, both models; `CASES` says which case covers what), and gpipe and
circular with `train.skip_bubbles`; the pipeline carry starts as NaN (bubbles never reach a
result); a circular engine's grads are put back in the logical layer order first. A train
step of each schedule updates the params like GPipe's, and EfficientNet's packed stages
under 1f1b, and under GPipe in two passes a step, give GPipe's loss and gradients (GPipe is
proven against the plain models in test_mesh_equivalence.py and test_packed_engine.py).
Tolerances are GPipe's: the same math summed in another order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_VISION
from helpers.lab import sgd_trace

from jaxpod.engine import abstract_engine, build_engine
from jaxpod.models.family import build_model, row_keys

LOSS_RTOL = 1e-6
GRAD_TOL = 3e-6
PARAM_ATOL = 1e-7  # one AdamW-free SGD step of ~1e-3: as test_memory_layouts.py
GPT = ("model.layers=8", "model.seq_len=32", "train.micro_batch=1", "train.grad_accum=null")
GPT += ("optim.warmup_steps=0", "optim.name=sgd", "optim.grad_clip=0")
BERT = (*GPT, "model.name=bert", "model.vocab=264")
SCHEDULES = {
    "gpipe": (),
    "circular": ("train.pipeline_schedule=circular", "train.virtual_stages=2"),
    "1f1b": ("train.pipeline_schedule=1f1b",),
    "zb-h1": ("train.pipeline_schedule=zb-h1",),
    "interleaved-1f1b": ("train.pipeline_schedule=interleaved-1f1b", "train.virtual_stages=2"),
    "zb-v": ("train.pipeline_schedule=zb-v", "train.virtual_stages=2"),
}
STEPWISE = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
# the new schedules with the options that reshape a stage: sequence parallelism, RTS, slices
SCHEDULES |= {
    "zb-h1+sp": (*SCHEDULES["zb-h1"], "model.sequence_parallel=true"),
    "zb-v+rts": (*SCHEDULES["zb-v"], "memory.rts=2", "memory.rts_optimizer=2"),
    "interleaved-1f1b+slices": (*SCHEDULES["interleaved-1f1b"], "memory.vocab_slices=2"),
    "zb-v+sp": (*SCHEDULES["zb-v"], "model.sequence_parallel=true"),
}
# a bubble tick computes nothing (`lax.cond`); the carry's NaN bubble fill must not leak
SKIPPING = {f"{k}-skip": (*SCHEDULES[k], "train.skip_bubbles=true") for k in ("gpipe", "circular")}
# activations offloaded: a forward-only table's stage traces its layers one by one
# (`StackOptions.layer_loop`); the CPU program keeps them on the device, same math
OFFLOADED = {
    f"{k}+offload": (*{**SCHEDULES, **SKIPPING}[k], "memory.offload=[activations]")
    for k in ("circular", "gpipe-skip")
}
ROWS = 8  # every case's global batch: replica x M micro-batches of 1 sequence


def tokens_of(rows: int, seq: int = 32) -> np.ndarray:
    return np.random.default_rng([11, rows]).integers(0, 256, (rows, seq + 1), np.int32)


@functools.cache
def plain_model(model: str):
    """(graphdef, initial params as numpy, seed) of the plain model, built on one device."""
    from helpers import make_tiny_cfg

    cfg = make_tiny_cfg(*(BERT if model == "bert" else GPT), mesh=(1, 1, 1))
    graphdef, state = nnx.split(build_model(cfg.model, cfg.train.seed))
    return graphdef, jax.device_get(nnx.to_pure_dict(state)), cfg.train.seed


@functools.cache
def reference(model: str, rows: int):
    """Plain (loss, grads) of the whole batch of `rows` sequences on one device."""
    graphdef, params, seed = plain_model(model)
    tokens = tokens_of(rows)
    if model == "bert":
        keys = row_keys(seed, 0, jnp.arange(rows))
        fn = lambda p: nnx.merge(graphdef, p)(tokens, keys)  # noqa: E731
    else:
        fn = lambda p: nnx.merge(graphdef, p)(tokens)  # noqa: E731
    return jax.jit(jax.value_and_grad(fn))(params)


def logical(engine, grads):
    """Grads in the model's layer order (circular engines store the layers round-robin)."""
    order = engine.stages.layer_order
    if order is None:
        return grads
    back = np.argsort(order)
    return {**grads, "layers": jax.tree.map(lambda a: np.asarray(a)[back], grads["layers"])}


def stored(engine, params):
    """The logical `params` with the layers in the engine's stored order."""
    order = engine.stages.layer_order
    if order is None:
        return params
    return {**params, "layers": jax.tree.map(lambda a: a[order], params["layers"])}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def schedule_cfg(tiny_cfg, model, mesh, micro, schedule):
    """The config of `model` on `mesh` with `micro` micro-batches of 1 sequence per replica."""
    base = BERT if model == "bert" else GPT
    extra = {**SCHEDULES, **SKIPPING, **OFFLOADED}[schedule]
    cfg = tiny_cfg(*base, f"train.global_batch={mesh[0] * micro}", *extra, mesh=mesh)
    assert cfg.train.grad_accum == micro and cfg.global_batch == ROWS
    return cfg


def assert_matches_reference(engine, model, loss, grads, what: str) -> None:
    """`loss` and `grads` (in the engine's stored layer order) == the plain model's."""
    want_loss, want = reference(model, ROWS)
    assert abs(float(loss) - float(want_loss)) <= LOSS_RTOL * abs(float(want_loss))
    got = jax.tree_util.tree_leaves_with_path(logical(engine, jax.device_get(grads)))
    errs = {
        jax.tree_util.keystr(k): rel_err(g, w)
        for (k, g), w in zip(got, jax.tree.leaves(want), strict=True)
    }
    worst = max(errs, key=errs.get)
    print(f"{what}: worst grad {worst} {errs[worst]:.1e}")
    assert errs[worst] <= GRAD_TOL, errs


# Which case proves what (GPipe's engine equivalence is test_mesh_equivalence.py's; the
# executors themselves are checked for every S in {2, 4} and M in {S, 2S, 4S} in
# tests/parallel/test_schedules.py; benchmarks/check_schedules.py runs the whole model x
# mesh x M x schedule matrix). Per schedule, circular and the stepwise ones:
#   bert 2x4x1, M = S:   BERT (masked-token weights, per-row keys), replica > 1, depth 4
#   gpt 1x2x4, M = 4S:   GPT, tensor width 4
#   gpt 2x2x2, M = 2S:   replica > 1, tensor 2: test_a_train_step_updates_like_gpipe
#                        (circular skipping its bubbles there)
# and gpipe skipping its bubbles and the new ones on 4 stages (gpt 1x4x1, M = 2S); the new
# ones with sequence parallelism (gpt, bert 1x2x2), RTS (gpt 2x2x1) and vocabulary slices.
# These cases run the engine's loss and gradients at the plain model's own initial params,
# put in the engine's shardings and stored layer order (no init program per case); the
# engine's init is the train step's here (both layer orders) and test_mesh_equivalence.py's
# / test_init.py's.
CASES = [("bert", (2, 4, 1), 4, k) for k in ("circular", *STEPWISE)]
CASES += [("gpt", (1, 2, 4), 8, k) for k in ("circular", *STEPWISE)]
CASES += [("gpt", (1, 4, 1), 8, k) for k in ("gpipe-skip", "zb-h1", "interleaved-1f1b", "zb-v")]
CASES += [("gpt", (1, 2, 2), 8, k) for k in ("zb-h1+sp", "interleaved-1f1b+slices")]
CASES += [("gpt", (2, 2, 1), 4, "zb-v+rts"), ("bert", (1, 2, 2), 8, "zb-v+sp")]
CASES += [("gpt", (1, 2, 2), 8, f"{k}+offload") for k in ("circular", "gpipe-skip")]


@pytest.mark.parametrize(
    ("model", "mesh", "micro", "schedule"),
    CASES,
    ids=[f"{m}-{'x'.join(map(str, s))}-M{n}-{k}" for m, s, n, k in CASES],
)
def test_schedule_matches_the_single_device_reference(
    tiny_cfg, mesh_for, model, mesh, micro, schedule
):
    cfg = schedule_cfg(tiny_cfg, model, mesh, micro, schedule)
    engine, state = abstract_engine(cfg, mesh_for(cfg), bubble_fill=float("nan"))
    assert engine.stages.stack_options.layer_loop == schedule.endswith("+offload")
    params = stored(engine, plain_model(model)[1])
    params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, state.params))
    batch = jax.device_put((tokens_of(ROWS),), engine.batch_sharding)
    loss, _, grads = jax.jit(engine.loss_and_grads)(params, batch)
    assert_matches_reference(engine, model, loss, grads, f"{model} {schedule} {mesh} M={micro}")


# the train step's schedules: circular skips its bubbles (its plain ticks: `CASES`)
STEP_SCHEDULES = ("gpipe", "circular-skip", *STEPWISE)


def test_a_train_step_updates_like_gpipe(tiny_cfg, mesh_for):
    """One SGD step of each schedule on 2x2x2 (M = 2S, the carry NaN-filled): its loss and
    gradients equal the single-device reference's (the gradients read from SGD's momentum
    trace, which after one step with no weight decay is g + 0.9 * 0 = g), and circular's
    and 1f1b's loss and updated params (in the logical layer order) equal GPipe's."""
    batch = tokens_of(ROWS)
    out = {}
    for name in STEP_SCHEDULES:
        cfg = schedule_cfg(tiny_cfg, "gpt", (2, 2, 2), 4, name)
        assert cfg.optim.weight_decay == 0
        engine, state = build_engine(cfg, mesh_for(cfg), bubble_fill=float("nan"))
        state, metrics = engine.train_step(state, jax.device_put((batch,), engine.batch_sharding))
        trace = sgd_trace(state.opt_state)
        assert_matches_reference(engine, "gpt", metrics["loss"], trace, f"{name} step 2x2x2")
        out[name] = (float(metrics["loss"]), logical(engine, jax.device_get(state.params)))
    for name in STEP_SCHEDULES[1:]:
        assert abs(out[name][0] - out["gpipe"][0]) <= LOSS_RTOL * out["gpipe"][0]
        for a, b in zip(*(jax.tree.leaves(out[k][1]) for k in (name, "gpipe")), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=PARAM_ATOL)


# the tiny EfficientNet on two packed stages, 2 micro-batches per replica
VISION = TINY_VISION


# GPipe in two passes of one micro-batch (`train.pipeline_group=1`, gradients summed)
PASSES = ("train.pipeline_group=1",)


def test_stepwise_schedules_on_efficientnet_heterogeneous_stages(tiny_cfg, mesh_for):
    """1F1B and ZB-H1 on EfficientNet's two packed stages (4x2x1, 2 micro-batches), and GPipe
    taking them in two passes: GPipe's loss, correct count and gradients of every stage row
    (GPipe's are proven against the plain network in tests/engine/test_packed_engine.py)."""
    from jaxpod.data.images import load_images

    digits = load_images("digits", image_size=32, seed=0)
    results, params = {}, None
    kinds = (("gpipe", ()), ("1f1b", SCHEDULES["1f1b"]), ("zb-h1", SCHEDULES["zb-h1"]))
    for name, extra in (*kinds, ("gpipe-passes", PASSES)):
        cfg = tiny_cfg(*VISION, *extra, mesh=(4, 2, 1))
        assert cfg.train.grad_accum == 2 and cfg.pipeline_passes == (2 if extra == PASSES else 1)
        if params is None:  # the init (one program: it does not depend on the schedule)
            engine, state = build_engine(cfg, mesh_for(cfg), bubble_fill=float("nan"))
            params = state.params
        else:
            engine = abstract_engine(cfg, mesh_for(cfg), bubble_fill=float("nan"))[0]
        g = cfg.global_batch
        batch = jax.device_put(digits.train_batch(0, 0, g, g), engine.batch_sharding)
        results[name] = jax.device_get(jax.jit(engine.loss_and_grads)(params, batch))
    l1, a1, g1 = results["gpipe"]
    for name in ("1f1b", "zb-h1", "gpipe-passes"):
        l2, a2, g2 = results[name]
        assert abs(float(l2) - float(l1)) <= LOSS_RTOL * abs(float(l1)), name
        assert int(a1["correct"]) == int(a2["correct"]), name
        for k in g1:
            assert rel_err(g2[k], g1[k]) <= GRAD_TOL, (name, k, rel_err(g2[k], g1[k]))

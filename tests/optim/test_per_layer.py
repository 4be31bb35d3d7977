"""The layer-by-layer optimizer update (`jaxpod.optim.per_layer`) against the whole-tree one.

Same arithmetic on float32 (to rounding), the same step up to one ulp of stochastic rounding on
float16, skipped bit-identically on overflow, and XLA's temporaries measured in one run: the
point of it is that the FP16 + LAMB update holds no float32 copy of the whole model.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxpod.engine import abstract_engine, build_engine
from jaxpod.inspect.compile import compile_to_inspect
from jaxpod.optim.guarded import guarded_update, whole_tree
from jaxpod.optim.per_layer import per_layer
from jaxpod.optim.precision import to_float32
from jaxpod.optim.strips import MIN_STRIP, strips

pytestmark = pytest.mark.engine  # compiles whole train steps: `make test` only

FP16 = ["precision.params=float16", "precision.master=same-as-params"]
FP16 += ["precision.loss_scale=dynamic", "precision.loss_scale_init=1024"]
STRIP = 1024  # elements: every tiny weight matrix and the embedding are updated in 8 strips
# float32 params and moments, layer by layer vs whole tree: measured at most 6e-8 apart
# (test_float32_layerwise_equals_whole_tree)
F32_ATOL = 1.2e-7


@functools.cache  # the fp16 tests share one engine and its jitted updates (nothing donated)
def _setup(tiny_cfg, mesh_for, name, *extra):
    cfg = tiny_cfg(
        f"optim.name={name}",
        "optim.grad_clip=0.05",
        "optim.warmup_steps=0",
        *extra,
        mesh=(1, 2, 2),
    )
    engine, state = build_engine(cfg, mesh_for(cfg))
    params, tx = state.params, state.opt_state.tx
    grads = jax.tree.map(lambda p, g: jax.device_put(g, p.sharding), params, _draw(params))
    return cfg, engine, params, tx, state.opt_state.loss_scale, grads


def _draw(params) -> dict:
    """Random (loss-scaled) gradients like `params`, as numpy arrays: drawn with numpy, not
    jax.random, which compiles a program for every shape it draws."""
    rng = np.random.default_rng(7)
    return jax.tree.map(
        lambda p: (rng.standard_normal(p.shape) * 1024.0 * 0.01).astype(p.dtype), params
    )


_JITTED: dict = {}


def _jitted_updates(cfg, engine):
    """`_updates` at key 0, the layer-by-layer one jitted: once per engine (of `_setup`)."""
    if id(engine) not in _JITTED:
        whole, lean = _updates(cfg, engine, jax.random.key(0))
        _JITTED[id(engine)] = whole, jax.jit(lean)
    return _JITTED[id(engine)]


def _updates(cfg, engine, key, min_strip=STRIP):
    """(whole-tree, layer-by-layer) guarded updates `(grads, tx, params, loss_scale) ->
    (params, tx, loss_scale, info)` of the engine's optimizer."""
    stages = engine.stages
    grad_sq, apply = per_layer(
        stages.optimizer,
        stages.masks.stacked,
        stages=cfg.mesh.pipeline,
        devices=cfg.devices,
        min_strip=min_strip,
    )
    kw = dict(max_norm=cfg.optim.grad_clip)
    whole = lambda g, s, p, ls: guarded_update(  # noqa: E731
        whole_tree(stages.optimizer), g, s, p, ls, key, cfg.precision, **kw
    )
    lean = lambda g, s, p, ls: guarded_update(  # noqa: E731
        apply, g, s, p, ls, key, cfg.precision, grad_sum_squares=grad_sq, **kw
    )
    return whole, lean


def _both(cfg, engine, params, tx, ls, grads, key):
    whole, lean = _updates(cfg, engine, key)
    return jax.jit(whole)(grads, tx, params, ls), jax.jit(lean)(grads, tx, params, ls)


@pytest.mark.parametrize("name", ["lamb", "lars", "adamw"])
def test_float32_layerwise_equals_whole_tree(tiny_cfg, mesh_for, name):
    cfg, engine, params, tx, ls, grads = _setup(tiny_cfg, mesh_for, name)
    (p1, s1, ls1, i1), (p2, s2, ls2, i2) = _both(
        cfg, engine, params, tx, ls, grads, jax.random.key(0)
    )
    assert float(i1["grad_norm"]) > cfg.optim.grad_clip  # the clip is exercised
    np.testing.assert_allclose(float(i2["grad_norm"]), float(i1["grad_norm"]), rtol=1e-6)
    update_norm = lambda info: np.sqrt(float(info["update_sq"]))  # noqa: E731
    # measured: update norms 9e-8 relative apart, params and moments at most
    # 6e-8 (lamb), 7.5e-9 (adamw), 4.7e-10 (lars) absolute; the bounds are 11x and 2x the
    # largest
    np.testing.assert_allclose(update_norm(i2), update_norm(i1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=F32_ATOL)
    assert not np.allclose(np.asarray(p2["layers"]["mlp"]["w_in"]), params["layers"]["mlp"]["w_in"])
    assert ls1 == ls2


def test_float16_layerwise_rounds_to_a_neighbour_of_the_whole_tree_step(tiny_cfg, mesh_for):
    """Every float16 parameter after the layer-by-layer step is one of the two float16 values
    around the whole-tree step's float32 result `p + u`, the value the whole-tree float16
    step rounds stochastically (`precision.apply_updates`): that value is the same whole-tree
    update of the float32 upcasts (float32 leaves are added, not rounded), a program a
    fraction of the float16 one's compile. Up to the float32 rounding the two paths differ
    by (`F32_ATOL`, test_float32_layerwise_equals_whole_tree) and the step moves most
    weights."""
    cfg, engine, params, tx, ls, grads = _setup(tiny_cfg, mesh_for, "lamb", *FP16)
    whole, lean = _jitted_updates(cfg, engine)
    upcast = jax.jit(lambda g, s, p, scale: whole(*map(to_float32, (g, s, p)), scale))
    (p1, _, _, i1), (p2, _, _, i2) = upcast(grads, tx, params, ls), lean(grads, tx, params, ls)
    assert bool(i1["finite"]) and bool(i2["finite"])
    assert {a.dtype for a in jax.tree.leaves(p1)} == {np.dtype(np.float32)}
    moved = 0
    for a, b, old in zip(*map(jax.tree.leaves, (p1, p2, params)), strict=True):
        assert b.dtype == np.float16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(a - b) <= ulp + F32_ATOL)  # b rounds the float32 value a
        moved += int(np.sum(b != np.asarray(old, np.float32)))
    assert moved > 0.5 * sum(x.size for x in jax.tree.leaves(params))


def test_overflow_leaves_the_state_bit_identical(tiny_cfg, mesh_for):
    """The layer-by-layer update (the previous test's engine and jitted program) of gradients
    with one inf leaves params and optimizer state bit-identical."""
    cfg, engine, params, tx, ls, grads = _setup(tiny_cfg, mesh_for, "lamb", *FP16)
    bad = _draw(params)
    bad["layers"]["attn"]["w_o"][1, 0, 0] = np.inf
    bad = jax.tree.map(lambda p, g: jax.device_put(g, p.sharding), params, bad)
    lean = _jitted_updates(cfg, engine)[1]
    p2, s2, ls2, info = lean(bad, tx, params, ls)
    assert not bool(info["finite"])
    for a, b in zip(jax.tree.leaves((params, tx)), jax.tree.leaves((p2, s2)), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(ls2.scale) == 512.0 and int(ls2.skipped) == 1


@pytest.mark.xdist_group("temporaries")  # compiles for ~100 s: its own unit of work
def test_float16_lamb_update_holds_a_fraction_of_the_whole_tree_temporaries(tiny_cfg, mesh_for):
    """XLA's temp bytes of the updates, compiled from abstract shapes in one run: the
    tensor-by-tensor update keeps one layer of one tensor in float32 (8 layers, 4 per stage),
    and in strips a fraction of that."""
    cfg = tiny_cfg(
        *FP16,
        "optim.name=lamb",
        "model.layers=8",
        "model.d_model=512",
        "model.d_ff=2048",
        "model.heads=4",
        mesh=(1, 2, 2),
    )
    engine, state = abstract_engine(cfg, mesh_for(cfg))
    args = (state.params, state.opt_state.tx, state.params, state.opt_state.loss_scale)
    key = jax.random.key(0)

    def temps(update):  # the step keeps the new params/state and two norms, as the engine does
        def fn(*a):
            params, opt_state, ls, info = update(*a)
            return params, opt_state, ls, info["grad_norm"], info["update_sq"]

        return compile_to_inspect(jax.jit(fn).lower(*args)).memory_analysis().temp_size_in_bytes

    whole = temps(_updates(cfg, engine, key)[0])
    lean = lambda min_strip: temps(_updates(cfg, engine, key, min_strip)[1])  # noqa: E731
    in_strips, whole_layers = lean(MIN_STRIP), lean(2**62)
    print(
        f"temporaries: whole {whole / 1e6:.1f} MB, layer by layer {whole_layers / 1e6:.1f} MB, "
        f"in strips {in_strips / 1e6:.1f} MB"
    )
    # measured: whole 82.0 MB; one layer of each tensor at a time 14.8 MB (a 16-bit copy of
    # the stacked weights for the loop carries + one layer of one tensor in float32); in
    # strips (8 of each MLP matrix's 1,048,576 values) 3.9 MB; 13 MB of float16 weights/device
    assert whole_layers < 0.25 * whole, (whole_layers, whole)
    assert in_strips < 0.5 * whole_layers, (in_strips, whole_layers)


def test_strips_keep_each_strip_inside_its_shard():
    """Strided strips of the largest axis that strips x devices divides, never the stage axis
    of a layer slice, as many as keep MIN_STRIP elements each (8 at most)."""
    assert strips((4096, 1024), devices=16, leading=False) == (0, 8)
    assert strips((8, 12288, 49152), devices=256, leading=True) == (2, 8)
    assert strips((8, 1024, 64), devices=1, leading=True) == (-1, 1)  # 65,536: whole
    assert strips((2, 256, 1024), devices=4, leading=True) == (2, 4)
    assert strips((30528, 1024), devices=16, leading=False) == (1, 8)  # 30528 % 128
    assert strips((3, 7), devices=1, leading=False, min_strip=1) == (-1, 1)

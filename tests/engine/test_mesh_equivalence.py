"""The engine's proofs: every sharded computation equals the plain single-device one.

The *reference* is computed the plain way, on one device, with no shard_map, no pipeline and no
micro-batching: `model = build_model(cfg.model, seed)`, `jax.value_and_grad` of
`nnx.merge(graphdef, params)(tokens)` over the whole global batch, then the same optax chain
from `make_optimizer`. The engine runs the same config on (replica, pipeline, tensor) meshes of
1-8 virtual CPU devices. Each mesh's engine is built once per module (`Lab` caches it).

Errors are measured per leaf as max|got - want| / max|want| ("leaf-relative") unless stated.
Run with `-s` to see every measured error.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import CHOICES
from jaxpod.engine import abstract_engine, build_engine
from jaxpod.engine.stacked import build_model
from jaxpod.models.params import masks
from jaxpod.optim.chains import make_optimizer
from jaxpod.parallel.mesh import shardings
from jaxpod.parallel.pipeline import gpipe
from jaxpod.parallel.remat import REMAT_POLICIES

# --------------------------------------------------------------------------------------------
# Tolerances. Everything is fp32; the mesh only changes the order of summation (psums of
# partial dots / partial batch sums, micro-batch accumulation, the pipeline's reduce-scatter),
# so differences are rounding noise. Each constant is 2-7x the largest error measured over
# all meshes and both optimizers (run with -s to print them; measured on jax 0.10.2 CPU).
# --------------------------------------------------------------------------------------------
# Mean loss (~5.55): measured max relative error 3.4e-7 (4 ulp of 5.55).
LOSS_RTOL = 1e-6
# Gradients, leaf-relative: measured max 8.6e-7 (w_qkv); most leaves ~1e-7.
GRAD_TOL = 3e-6
# Parameters after one update, elementwise: |got - want| <= PARAM_ULPS * ulp(want) + |du|, where
#  * PARAM_ULPS covers rounding p + u to fp32 and the 1-ulp difference of the initial values
#    (jitted vs eager init, see INIT_ATOL); measured max 2 ulp.
#  * |du| is how far the update can move if the gradient is off by dg = GRAD_TOL * max|g_leaf|
#    (what the gradient check allows), derived, not fitted:
#      SGD:   u = -lr * g                       ->  |du| <= lr * dg
#      AdamW: u = -lr * (g / (|g| + eps) + wd p) ->  |du| <= lr * dg / (|g| + eps)
#    AdamW's first step is ~lr * sign(g): insensitive where |g| >> eps, but it amplifies
#    rounding noise where the true gradient is 0. The key bias b_qkv[:, 1] is such a leaf
#    (softmax ignores a per-query constant): its computed gradient is noise of ~1e-11 that
#    differs per mesh, so its update (~lr * noise / eps) is only bounded, not reproducible.
PARAM_ULPS = 4
ADAM_EPS = 1e-8  # optax.adamw's default eps (jaxpod.optim.chains does not set it)
# Initial parameters vs the eagerly built reference model: the jitted init rounds
# `0.02 * normal` differently from eager mode in ~27% of the weights, by exactly 1 ulp.
# Measured max |diff| 7.5e-9 (1 ulp of ~0.06), max 1 ulp. Across meshes the jitted init is
# bit-identical (asserted exactly).
INIT_ATOL = 1e-7
INIT_MAX_ULP = 1
# The logged global norms (grad/update/param) vs optax.tree.norm of the reference trees:
# measured max relative error 1.5e-7.
NORM_RTOL = 1e-6
# Remat policies recompute the same ops, but XLA fuses the recomputation differently (a few
# ulp per op). Measured max leaf-relative difference 4.8e-7 (full vs none, wpe).
REMAT_TOL = 2e-6
# gpipe vs applying the stages in order in a plain loop: the same ops, but fused differently
# inside the scan. Measured max leaf-relative 2.4e-7.
GPIPE_TOL = 1e-6

MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4)]
PIPELINED = [(1, 2, 1), (2, 2, 2), (1, 4, 2)]
GLOBAL_BATCH = 16
# micro_batch * replica * grad_accum = 16 on every mesh (grad_accum is derived). No warm-up,
# so the first step's learning rate is the full lr and the update is not vacuous.
BASE = (
    f"train.global_batch={GLOBAL_BATCH}",
    "train.grad_accum=null",
    "train.micro_batch=2",
    "optim.grad_clip=0",
    "optim.warmup_steps=0",
)
# SGD without weight decay: after step 1 its momentum trace is exactly the gradient.
OPTIM = {
    "sgd": ("optim.name=sgd",),
    "adamw": ("optim.name=adamw", "optim.weight_decay=0.1"),
    "lars": ("optim.name=lars", "optim.weight_decay=0.1", "optim.trust_coefficient=0.02"),
    "lamb": ("optim.name=lamb", "optim.weight_decay=0.1"),
}

EXPECTED_SPECS = {
    "wte": P("tensor", None),
    "wpe": P(None, None),
    "ln_f": {"scale": P(None), "bias": P(None)},
    "layers": {
        "ln1": {"scale": P("pipeline", None), "bias": P("pipeline", None)},
        "ln2": {"scale": P("pipeline", None), "bias": P("pipeline", None)},
        "attn": {
            "w_qkv": P("pipeline", None, None, "tensor"),
            "b_qkv": P("pipeline", None, "tensor"),
            "w_o": P("pipeline", "tensor", None),
            "b_o": P("pipeline", None),
        },
        "mlp": {
            "w_in": P("pipeline", None, "tensor"),
            "b_in": P("pipeline", "tensor"),
            "w_out": P("pipeline", "tensor", None),
            "b_out": P("pipeline", None),
        },
    },
}


def batch(step: int, rows: int = GLOBAL_BATCH, seq_len: int = 64) -> np.ndarray:
    """Seeded token batch `int32[rows, seq_len + 1]` for optimizer step `step`."""
    return np.random.default_rng([2024, step]).integers(0, 256, (rows, seq_len + 1), np.int32)


def put(engine, tokens):
    """The engine's batch `(tokens,)`, split over its batch axes."""
    return jax.device_put((tokens,), engine.batch_sharding)


def reference_optimizer(cfg):
    """`make_optimizer` masked by the model's parameter roles, as the engine builds it (but
    clipping inside the chain: the plain optax way)."""
    roles = masks(nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, cfg.train.seed))))
    return make_optimizer(
        cfg.optim, cfg.train.steps, decay_mask=roles.decay, stacked_mask=roles.stacked
    )


def loss_and_grads_of(lab, cfg, **kw):
    """`(fn(params, tokens) -> (loss, grads), abstract params, specs)` of cfg's engine."""
    engine, state = abstract_engine(cfg, lab.mesh_for(cfg), **kw)

    def fn(params, tokens):
        loss, _, grads = engine.loss_and_grads(params, (tokens,))
        return loss, grads

    return fn, state.params, engine.stages.specs


def mesh_id(shape) -> str:
    return "x".join(map(str, shape))


def copy_tree(tree):
    """Fresh buffers with the same shardings (train_step donates its state)."""
    return jax.tree.map(lambda a: a.copy(), tree)


def leaves(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(k, simple=True, separator="."): np.asarray(v) for k, v in flat}


MEASURED: dict[str, float] = {}


def record(kind: str, value: float) -> None:
    MEASURED[kind] = max(MEASURED.get(kind, 0.0), value)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.max(np.abs(want))
    return float(np.max(np.abs(got - want)) / scale) if scale else float(np.max(np.abs(got)))


def assert_loss_close(got, want, what: str) -> None:
    err = abs(float(got) - float(want)) / abs(float(want))
    record(f"loss ({what})", err)
    assert np.isfinite(float(got)), what
    assert err <= LOSS_RTOL, f"{what}: loss {float(got)!r} vs {float(want)!r} (rel {err:.2e})"


def assert_trees_close(got, want, tol: float, what: str) -> None:
    """Same structure; every leaf finite and leaf-relative error <= tol."""
    g, w = leaves(got), leaves(want)
    assert g.keys() == w.keys(), what
    errs = {k: rel_err(g[k], w[k]) for k in w}
    worst = max(errs, key=errs.get)
    record(what, errs[worst])
    print(f"{what}: worst leaf {worst} {errs[worst]:.2e}")
    for k in w:
        assert np.all(np.isfinite(g[k])), f"{what}: {k} not finite"
    bad = {k: f"{e:.2e}" for k, e in errs.items() if e > tol}
    assert not bad, f"{what}: leaves over tol {tol:.0e}: {bad}"


def update_bound(optim: str, grads, lr: float) -> dict[str, np.ndarray]:
    """Per-element |du| allowed by the gradient tolerance (see PARAM_ULPS)."""
    out = {}
    for k, g in leaves(grads).items():
        dg = GRAD_TOL * float(np.max(np.abs(g)))
        if optim == "sgd":
            out[k] = np.full(g.shape, lr * dg)
        else:
            out[k] = lr * dg / (np.abs(g).astype(np.float64) + ADAM_EPS)
    return out


def assert_params_close(got, want, old, bound: dict[str, np.ndarray], what: str) -> None:
    """Elementwise |got - want| <= PARAM_ULPS * ulp(want) + bound, and the check has teeth:
    the update itself (want - old) is mostly far larger than what is allowed."""
    g, w, o = leaves(got), leaves(want), leaves(old)
    assert g.keys() == w.keys() == o.keys(), what
    worst_ratio, worst_ulps, teeth = 0.0, 0.0, []
    for k in w:
        assert np.all(np.isfinite(g[k])), f"{what}: {k} not finite"
        ulp = np.spacing(np.abs(w[k])).astype(np.float64)
        err = np.abs(g[k].astype(np.float64) - w[k])
        allowed = PARAM_ULPS * ulp + bound[k]
        ratio = err / allowed
        i = np.unravel_index(np.argmax(ratio), ratio.shape)
        assert ratio[i] <= 1, f"{what}: {k}{list(i)} = {g[k][i]!r}, want {w[k][i]!r}"
        worst_ratio = max(worst_ratio, float(ratio.max()))
        normal = np.abs(w[k]) >= 1e-3  # ulps of values near 0 are meaningless
        if normal.any():
            worst_ulps = max(worst_ulps, float(np.max(err[normal] / ulp[normal])))
        teeth.append(np.abs(w[k].astype(np.float64) - o[k]) / allowed)
    median = float(np.median(np.concatenate([t.ravel() for t in teeth])))
    record(f"{what}: |error| / allowed", worst_ratio)
    record(f"{what}: |error| in ulp where |param| >= 1e-3", worst_ulps)
    print(
        f"{what}: worst |error|/allowed {worst_ratio:.2f}, max {worst_ulps:.0f} ulp; "
        f"median |update|/allowed {median:.0f}"
    )
    assert median > 10, f"{what}: the update is too small for this check to mean anything"


def spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def local_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(
        d // math.prod(mesh.shape[a] for a in spec_axes(e))
        for d, e in zip(shape, spec, strict=True)
    )


def assert_sharded_as(tree, specs, mesh, what: str) -> None:
    """Every leaf has NamedSharding(mesh, spec) and each device holds only its own shard."""
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    flat = jax.tree.leaves(tree)
    assert len(flat) == len(flat_specs)
    for arr, spec in zip(flat, flat_specs, strict=True):
        want = NamedSharding(mesh, spec)
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (what, arr.sharding, spec)
        shard_shape = local_shape(arr.shape, spec, mesh)
        assert len(arr.addressable_shards) == mesh.size
        for shard in arr.addressable_shards:
            assert shard.data.shape == shard_shape, (what, spec, shard.data.shape, shard_shape)
            if "tensor" in jax.tree.leaves(tuple(spec)) and mesh.shape["tensor"] > 1:
                assert shard.data.size < arr.size, f"{what}: a device holds all of {spec}"


# --------------------------------------------------------------------------------------------
# The lab: configs, engines, one-step results and the reference, each computed once.
# --------------------------------------------------------------------------------------------


class Lab:
    def __init__(self, tiny_cfg, mesh_for):
        self.tiny_cfg, self.mesh_for = tiny_cfg, mesh_for
        self._memo: dict = {}

    def memo(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def cfg(self, shape, optim="adamw", *extra):
        return self.tiny_cfg(*BASE, *OPTIM[optim], *extra, mesh=shape)

    def engine(self, shape, optim):
        """(cfg, mesh, engine, initial state); the state is never donated (use copies)."""

        def build():
            cfg = self.cfg(shape, optim)
            mesh = self.mesh_for(cfg)
            engine, state = build_engine(cfg, mesh)
            return cfg, mesh, engine, state

        return self.memo(("engine", shape, optim), build)

    def steps(self, shape, optim, n: int):
        """[(new_state, metrics)] after each of n train steps on batch(0), batch(1), ..."""

        def run():
            cfg, mesh, engine, state = self.engine(shape, optim)
            state, out = copy_tree(state), []
            for k in range(n):
                state, metrics = engine.train_step(state, put(engine, batch(k)))
                out.append((copy_tree(state), jax.device_get(metrics)))
            return out

        return self.memo(("steps", shape, optim, n), run)

    def reference(self):
        """The plain single-device model: (graphdef, initial params, jitted value_and_grad)."""

        def build():
            cfg = self.cfg((1, 1, 1))
            model = build_model(cfg.model, cfg.train.seed)
            graphdef, state = nnx.split(model)
            loss_fn = lambda p, tokens: nnx.merge(graphdef, p)(tokens)
            return graphdef, nnx.to_pure_dict(state), jax.jit(jax.value_and_grad(loss_fn))

        return self.memo("reference", build)

    def ref_optimizer(self, optim):
        """(optax chain, schedule) from `make_optimizer` for the reference, masked by the
        model's parameter roles (no decay of biases and norms; per-layer trust ratios)."""
        cfg = self.cfg((1, 1, 1), optim)
        return reference_optimizer(cfg)

    def ref_steps(self, optim, n: int = 3):
        """[{loss, grads, params, opt_state, updates, old_params}] of n plain optimizer steps
        on batch(0), batch(1), ... (the step-0 loss and grads do not depend on `optim`)."""

        def run():
            _, params, loss_and_grads = self.reference()
            opt, _ = self.ref_optimizer(optim)

            @jax.jit
            def update(grads, opt_state, params):
                updates, opt_state = opt.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, updates

            opt_state, out = opt.init(params), []
            for k in range(n):
                if k == 0:
                    first = functools.partial(loss_and_grads, params, batch(0))
                    loss, grads = self.memo("reference step 0", first)
                else:
                    loss, grads = loss_and_grads(params, batch(k))
                new, opt_state, updates = update(grads, opt_state, params)
                step = dict(loss=loss, grads=grads, params=new, opt_state=opt_state)
                out.append(dict(step, updates=updates, old_params=params))
                params = new
            return out

        return self.memo(("ref_steps", optim, n), run)


@pytest.fixture(scope="module")
def lab(tiny_cfg, mesh_for):
    yield Lab(tiny_cfg, mesh_for)
    print("\nmeasured maxima:")
    for k, v in sorted(MEASURED.items()):
        print(f"  {k}: {v:.3e}")


# --------------------------------------------------------------------------------------------
# 1. Mesh equivalence: init, shardings, one optimizer step.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
def test_init_params_match_reference(lab, shape):
    """The engine's initial params on any mesh are the reference model's values (they depend
    only on the seed), bit-identical to the 1-device jitted init, in the engine's specs."""
    cfg, mesh, engine, state = lab.engine(shape, "adamw")
    params, specs = state.params, engine.stages.specs
    _, ref_params, _ = lab.reference()
    g, w = leaves(params), leaves(ref_params)
    assert g.keys() == w.keys()
    worst = max(float(np.max(np.abs(g[k] - w[k]))) for k in w)
    record("init |mesh - eager reference|", worst)
    assert worst <= INIT_ATOL
    for k in w:
        np.testing.assert_array_max_ulp(g[k], w[k], maxulp=INIT_MAX_ULP)
    one_device = leaves(lab.engine((1, 1, 1), "adamw")[3].params)
    for k in w:
        np.testing.assert_array_equal(g[k], one_device[k], err_msg=k)
    assert_sharded_as(params, specs, mesh, "initial params")


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
def test_specs_and_local_shards(lab, shape):
    """Specs are the Megatron/pipeline layout; params (initial and updated), the SGD trace
    (= grads) and AdamW moments live exactly there, and no device holds a whole tensor-split
    weight. (Grads straight out of `engine.loss_and_grads` are checked in the bubble tests.)"""
    cfg, mesh, engine, state = lab.engine(shape, "adamw")
    specs = engine.stages.specs
    assert specs == EXPECTED_SPECS
    assert_sharded_as(state.params, specs, mesh, "params")
    new_state, _ = lab.steps(shape, "adamw", 1)[0]
    assert_sharded_as(new_state.params, specs, mesh, "updated params")
    adam = adam_state(new_state.opt_state)
    assert_sharded_as(adam.mu, specs, mesh, "adam mu")
    assert_sharded_as(adam.nu, specs, mesh, "adam nu")
    sgd_state, _ = lab.steps(shape, "sgd", 1)[0]
    assert_sharded_as(sgd_trace(sgd_state.opt_state), specs, mesh, "grads (sgd trace)")


def find_state(opt_state, type_name: str):
    """The one optax state of type `type_name` inside a (nested) chain state."""
    found = []

    def walk(node):
        if type(node).__name__ == type_name:
            found.append(node)
        elif isinstance(node, tuple):
            for child in node:
                walk(child)

    walk(opt_state)
    assert len(found) == 1, (type_name, jax.tree.structure(opt_state))
    return found[0]


def adam_state(opt_state):
    return find_state(opt_state, "ScaleByAdamState")


def sgd_trace(opt_state):
    """The momentum trace of the SGD chain (add_decayed_weights, trace, scale_by_lr)."""
    return find_state(opt_state, "TraceState").trace


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
def test_one_step_matches_reference(lab, shape, optim):
    """One `engine.train_step` == one plain step: loss, every gradient leaf, every updated
    parameter leaf, the optimizer state and the logged norms.

    Gradients are read from the optimizer state the engine's own step produced: SGD's
    momentum trace after the first step is g + 0.9 * 0 = g exactly (asserted on the
    reference), AdamW's first moment is 0.1 * g and its second 0.05 * g**2.
    """
    cfg, mesh, engine, _ = lab.engine(shape, optim)
    new_state, metrics = lab.steps(shape, optim, 1)[0]
    ref = lab.ref_steps(optim)[0]
    lr = float(lab.ref_optimizer(optim)[1](0))
    assert lr == np.float32(cfg.optim.lr)  # no warm-up: the first step uses the full lr
    where = f"{optim} params"

    assert int(new_state.step) == 1
    assert_loss_close(metrics["loss"], ref["loss"], "one step")
    if optim == "sgd":
        ref_trace = leaves(sgd_trace(ref["opt_state"]))
        for k, v in leaves(ref["grads"]).items():
            np.testing.assert_array_equal(ref_trace[k], v, err_msg=k)
        assert_trees_close(sgd_trace(new_state.opt_state), ref["grads"], GRAD_TOL, "grads")
    else:
        adam, ref_adam = adam_state(new_state.opt_state), adam_state(ref["opt_state"])
        assert_trees_close(adam.mu, ref_adam.mu, GRAD_TOL, "adam mu = 0.1 g")
        assert_trees_close(adam.nu, ref_adam.nu, 2 * GRAD_TOL, "adam nu = 0.05 g^2")
    bound = update_bound(optim, ref["grads"], lr)
    assert_params_close(new_state.params, ref["params"], ref["old_params"], bound, where)
    norms = {"grad_norm": ref["grads"], "update_norm": ref["updates"], "param_norm": ref["params"]}
    for name, tree in norms.items():
        want = float(optax.tree.norm(tree))
        err = abs(float(metrics[name]) - want) / want
        record(f"metric {name} {optim}", err)
        assert err <= NORM_RTOL, (name, float(metrics[name]), want)
    assert float(metrics["lr"]) == lr


# --------------------------------------------------------------------------------------------
# 2. Several steps.
# --------------------------------------------------------------------------------------------


def test_three_adamw_steps_match(lab):
    """Three AdamW steps (fresh batch each) on 2x2x2 and on 1x1x1 log the reference's losses."""
    ref = lab.ref_steps("adamw")
    big, one = lab.steps((2, 2, 2), "adamw", 3), lab.steps((1, 1, 1), "adamw", 3)
    losses = [float(r["loss"]) for r in ref]
    print("reference losses", losses)
    for k in range(3):
        assert int(big[k][0].step) == k + 1
        assert_loss_close(big[k][1]["loss"], one[k][1]["loss"], "3 steps, 2x2x2 vs 1x1x1")
        assert_loss_close(big[k][1]["loss"], ref[k]["loss"], "3 steps, 2x2x2 vs reference")
        assert_loss_close(one[k][1]["loss"], ref[k]["loss"], "3 steps, 1x1x1 vs reference")


# --------------------------------------------------------------------------------------------
# 3. Pipeline micro-batching == gradient accumulation.
# --------------------------------------------------------------------------------------------


def sharded_loss_and_grads(lab, cfg, *, bubble_fill=0.0):
    """(loss, grads, specs, mesh): `engine.loss_and_grads` on cfg's mesh, from the engine's
    initial params, on batch(0) (the reference's first batch)."""
    mesh = lab.mesh_for(cfg)
    engine, state = build_engine(cfg, mesh, bubble_fill=bubble_fill)
    loss, _, grads = jax.jit(engine.loss_and_grads)(state.params, put(engine, batch(0)))
    return loss, grads, engine.stages.specs, mesh


def test_pipeline_microbatches_equal_accumulation(lab):
    """GPipe over 4 micro-batches on 2 stages == two GPipe passes of 2 micro-batches
    (`train.pipeline_group=2`, gradients summed) == the 4-step accumulation loop on 1 device
    == the plain full-batch gradient."""
    runs = {
        "pipeline": ((1, 2, 1), []),
        "pipeline, 2 passes": ((1, 2, 1), ["train.pipeline_group=2"]),
        "accumulation": ((1, 1, 1), []),
    }
    out = {}
    for name, (shape, extra) in runs.items():
        cfg = lab.cfg(shape, "adamw", "train.micro_batch=4", *extra)
        assert (cfg.train.grad_accum, cfg.global_batch) == (4, GLOBAL_BATCH)
        out[name] = sharded_loss_and_grads(lab, cfg)[:2]
    ref = lab.ref_steps("adamw")[0]
    (pipe_loss, pipe_grads), (acc_loss, acc_grads) = out["pipeline"], out["accumulation"]
    assert_loss_close(pipe_loss, acc_loss, "pipeline vs accumulation")
    assert_trees_close(pipe_grads, acc_grads, GRAD_TOL, "grads pipeline vs accumulation")
    for name, (loss, grads) in out.items():
        assert_loss_close(loss, ref["loss"], f"{name} vs reference")
        assert_trees_close(grads, ref["grads"], GRAD_TOL, f"grads {name} vs reference")


# --------------------------------------------------------------------------------------------
# 4. Pipeline bubbles never reach results.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", PIPELINED, ids=mesh_id)
def test_bubble_nan_never_reaches_loss_or_grads(lab, shape):
    """With the pipeline carry pre-filled with NaN, loss and grads are finite and equal the
    reference, and the grads come back with the params' shardings."""
    cfg = lab.cfg(shape, "adamw")
    loss, grads, specs, mesh = sharded_loss_and_grads(lab, cfg, bubble_fill=float("nan"))
    ref = lab.ref_steps("adamw")[0]
    assert_loss_close(loss, ref["loss"], "bubble_fill=nan")
    assert_trees_close(grads, ref["grads"], GRAD_TOL, "grads bubble_fill=nan")
    assert_sharded_as(grads, specs, mesh, "grads")


@pytest.mark.parametrize("stages", [2, 4])
def test_gpipe_direct(stages):
    """`gpipe` of `tanh(a @ W_s)` stages over a 'pipeline' axis == applying the stages in
    order to each micro-batch, forward and gradient (w.r.t. W and the inputs), with the
    carry pre-filled with NaN; NaN and 0 fills give bit-identical results. Without the input
    masking a bubble tick would compute `NaN @ W` and its W-gradient NaN * 0 = NaN."""
    micro, k = stages + 1, 8
    rng = np.random.default_rng(stages)
    w = (0.5 * rng.standard_normal((stages, k, k))).astype(np.float32)
    xs = rng.standard_normal((micro, 2, k)).astype(np.float32)
    cot = rng.standard_normal((micro, 2, k)).astype(np.float32)
    mesh = jax.make_mesh((stages,), ("pipeline",), (AxisType.Auto,), devices=jax.devices()[:stages])

    def pipe(fill):
        def local(w, xs):  # w: this stage's [1, k, k]
            return gpipe(lambda a: jnp.tanh(a @ w[0]), xs, bubble_fill=fill)[None]

        specs = dict(mesh=mesh, in_specs=(P("pipeline"), P()), out_specs=P("pipeline"))
        return jax.shard_map(local, **specs)  # -> [stages, micro, 2, k]

    def sequential(w, xs):
        outs = []
        for m in range(micro):
            a = xs[m]
            for s in range(stages):
                a = jnp.tanh(a @ w[s])
            outs.append(a)
        return jnp.stack(outs)

    want = sequential(w, xs)
    want_grads = jax.grad(lambda w, xs: jnp.sum(sequential(w, xs) * cot), argnums=(0, 1))(w, xs)
    results = {}
    for fill in ("nan", "0"):
        f = pipe(float(fill))
        ys = jax.jit(f)(w, xs)
        grads = jax.jit(jax.grad(lambda w, xs, f=f: jnp.sum(f(w, xs)[-1] * cot), argnums=(0, 1)))(
            w, xs
        )
        results[fill] = (ys, *grads)
        assert np.all(np.isfinite(ys)) and all(np.all(np.isfinite(g)) for g in grads), fill
        np.testing.assert_array_equal(ys[:-1], 0)  # only the last stage holds outputs
        for name, got, ref in [
            ("ys", ys[-1], want),
            ("dW", grads[0], want_grads[0]),
            ("dxs", grads[1], want_grads[1]),
        ]:
            err = rel_err(got, ref)
            record(f"gpipe direct {name}", err)
            assert err <= GPIPE_TOL, (fill, name, err)
    for a, b in zip(results["nan"], results["0"], strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# 5. Remat policies.
# --------------------------------------------------------------------------------------------


def test_remat_policy_names_match_config_choices():
    assert set(REMAT_POLICIES) == set(CHOICES["model.remat"])


@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
def test_remat_policy_gradients(lab, policy):
    """Every recomputation policy gives the `none` policy's loss and grads on 1x2x2 (and the
    reference's), and every policy but `none` really wraps the layers in a checkpoint."""

    def run(policy):
        cfg = lab.cfg((1, 2, 2), "adamw", f"model.remat={policy}")
        return lab.memo(("remat", policy), lambda: sharded_loss_and_grads(lab, cfg)[:2])

    loss, grads = run(policy)
    none_loss, none_grads = run("none")
    assert_trees_close(grads, none_grads, REMAT_TOL, f"remat grads {policy} vs none")
    assert abs(float(loss) - float(none_loss)) <= REMAT_TOL * abs(float(none_loss))
    ref = lab.ref_steps("adamw")[0]
    assert_trees_close(grads, ref["grads"], GRAD_TOL, f"remat grads {policy} vs reference")

    cfg = lab.cfg((1, 2, 2), "adamw", f"model.remat={policy}")
    fn, params, _ = loss_and_grads_of(lab, cfg)
    tokens = jax.ShapeDtypeStruct((GLOBAL_BATCH, cfg.model.seq_len + 1), jnp.int32)
    used = remat_policies_used(jax.make_jaxpr(fn)(params, tokens).jaxpr)
    assert used == ({REMAT_POLICIES[policy]} if policy != "none" else set()), used


def remat_policies_used(jaxpr) -> set:
    """The `policy` of every jax.checkpoint (remat) region in `jaxpr`, nested ones included."""
    found = set()
    for eqn in jaxpr.eqns:
        if "policy" in eqn.params and "prevent_cse" in eqn.params:
            found.add(eqn.params["policy"])
        for sub in jaxprs_in_params(eqn.params):
            found |= remat_policies_used(sub)
    return found


def test_full_remat_uses_less_temp_memory(lab):
    """`full` saves only each layer's input, so XLA's temp buffers for loss_and_grads shrink
    when activations dominate (1 device, seq 128, micro_batch 8, one micro-batch)."""
    temp = {}
    for policy in ("none", "full"):
        cfg = lab.tiny_cfg(
            "model.seq_len=128",
            "train.micro_batch=8",
            "train.grad_accum=1",
            "train.global_batch=null",
            f"model.remat={policy}",
            mesh=(1, 1, 1),
        )
        fn, params, _ = loss_and_grads_of(lab, cfg)
        tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
        memory = jax.jit(fn).lower(params, tokens).compile().memory_analysis()
        temp[policy] = memory.temp_size_in_bytes
    print(f"temp_size_in_bytes: none={temp['none']:,} full={temp['full']:,}")
    assert temp["full"] < temp["none"]


# --------------------------------------------------------------------------------------------
# 6. Eval.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 1)], ids=mesh_id)
def test_eval_loss_matches_reference(lab, shape):
    """`engine.eval_step` (forward only) == the plain loss of the same params and batch."""
    cfg, mesh, engine, state = lab.engine(shape, "adamw")
    loss = engine.eval_step(state.params, put(engine, batch(0)))["val_loss"]
    assert_loss_close(loss, lab.ref_steps("adamw")[0]["loss"], "eval")


# --------------------------------------------------------------------------------------------
# 7. The data-parallel gradient reduction happens once per optimizer step.
# --------------------------------------------------------------------------------------------

NO_DATA_MOVED = {"pvary", "pcast"}  # type-level casts to "varying": no communication


def executed_collectives(jaxpr, axis: str) -> Counter:
    """How many times each collective over `axis` *runs* per call: eqns inside a `scan` body
    count `length` times (nested scans multiply); one inside a `while` counts as NaN."""
    counts: Counter = Counter()

    def walk(j, times):
        for eqn in j.eqns:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, tuple | list | set | frozenset) else (axes,)
            if axis in axes and eqn.primitive.name not in NO_DATA_MOVED:
                counts[eqn.primitive.name] += times
            inner = times
            if eqn.primitive.name == "scan":
                inner = times * eqn.params["length"]
            elif eqn.primitive.name == "while":
                inner = math.nan
            for sub in jaxprs_in_params(eqn.params):
                walk(sub, inner)

    walk(jaxpr, 1)
    return counts


def test_gradient_reduction_once_per_step(lab):
    """On 2x1x1, the collectives over `replica` in `engine.loss_and_grads` run once per step:
    one psum per parameter leaf plus one for the loss, for 2 and for 4 micro-batches. The
    counter is not blind to loops: the per-micro-batch tensor-axis psums (Megatron, size-1
    axis here) double from 2 to 4 micro-batches."""
    replica, tensor = {}, {}
    for accum in (2, 4):
        cfg = lab.tiny_cfg(
            "train.micro_batch=2",
            f"train.grad_accum={accum}",
            "train.global_batch=null",
            mesh=(2, 1, 1),
        )
        assert cfg.global_batch == 2 * 2 * accum
        fn, params, _ = loss_and_grads_of(lab, cfg)
        tokens = jax.ShapeDtypeStruct((cfg.global_batch, cfg.model.seq_len + 1), jnp.int32)
        jaxpr = jax.make_jaxpr(fn)(params, tokens).jaxpr
        replica[accum], tensor[accum] = (
            executed_collectives(jaxpr, a) for a in ("replica", "tensor")
        )
    n_leaves = len(jax.tree.leaves(params))
    print(
        f"replica collectives per step: {dict(replica[2])} / {dict(replica[4])}; tensor: "
        f"{sum(tensor[2].values())} / {sum(tensor[4].values())} (grad_accum 2 / 4)"
    )
    assert replica[2] == replica[4]
    assert sum(replica[4].values()) == n_leaves + 1
    assert set(replica[4]) <= {"psum", "psum_invariant"}
    assert sum(tensor[4].values()) == 2 * sum(tensor[2].values()) > 0


# --------------------------------------------------------------------------------------------
# 8. LARS / LAMB: trust ratios of sharded parameters use whole-parameter (per-layer) norms.
# --------------------------------------------------------------------------------------------
# The optax chain runs under GSPMD on the globally sharded arrays, so every norm is a
# reduction over the whole array and XLA inserts the cross-shard sums. To test exactly that,
# the sharded update is fed the reference's own gradients and parameters (sharded onto the
# mesh): only the order of the norms' sums differs. (With the mesh's own gradients, Adam's
# first step g / (|g| + eps) in LAMB amplifies their rounding noise where |g| ~ eps, as for
# AdamW above; the engine test below checks the full steps through the losses.) Measured max
# leaf-relative error: 3.5e-7 (lars and lamb, all three meshes).
TRUST_TOL = 4 * GRAD_TOL
TRUST_MESHES = [(2, 2, 2), (1, 4, 2), (2, 1, 4)]


def trust_updates(lab, shape, optim):
    """One optimizer update under GSPMD (as in the engine) of the reference's step-0 grads
    and params, sharded with the engine's specs on `shape`."""
    cfg = lab.cfg(shape, optim)
    mesh = lab.mesh_for(cfg)
    specs = abstract_engine(cfg, mesh)[0].stages.specs
    ref = lab.ref_steps(optim, 2)[0]
    to_mesh = lambda tree: jax.device_put(tree, shardings(mesh, specs))
    grads, params = to_mesh(ref["grads"]), to_mesh(ref["old_params"])
    assert_sharded_as(grads, specs, mesh, "sharded reference grads")
    opt, _ = reference_optimizer(cfg)
    return jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[0])(grads, params)


@pytest.mark.parametrize("optim", ["lars", "lamb"])
@pytest.mark.parametrize("shape", TRUST_MESHES, ids=mesh_id)
def test_trust_ratio_optimizers_sharded_match_reference(lab, shape, optim):
    """LARS/LAMB updates of the tensor- and pipeline-sharded grads == the reference updates.

    Teeth: on this mesh a trust ratio taken over one tensor shard of `w_in` (per layer) would
    be off by more than 10x the tolerance (computed from the reference arrays)."""
    updates = trust_updates(lab, shape, optim)
    ref = lab.ref_steps(optim, 2)[0]
    assert_trees_close(updates, ref["updates"], TRUST_TOL, f"{optim} updates {mesh_id(shape)}")
    t = lab.mesh_for(lab.cfg(shape, optim)).shape["tensor"]
    if t > 1:
        p = np.asarray(ref["old_params"]["layers"]["mlp"]["w_in"], np.float64)
        u = np.asarray(ref["updates"]["layers"]["mlp"]["w_in"], np.float64)
        whole = np.linalg.norm(p, axis=(1, 2)) / np.linalg.norm(u, axis=(1, 2))
        shard = [
            np.linalg.norm(ps, axis=(1, 2)) / np.linalg.norm(us, axis=(1, 2))
            for ps, us in zip(np.split(p, t, axis=2), np.split(u, t, axis=2), strict=True)
        ]
        wrong = max(float(np.max(np.abs(r / whole - 1))) for r in shard)
        print(f"shard-local trust ratio would be off by {wrong:.1e}")
        assert wrong > 10 * TRUST_TOL


@pytest.mark.parametrize("optim", ["lars", "lamb"])
def test_trust_ratio_engine_steps_match_reference(lab, optim):
    """Two `train_step`s with LARS/LAMB on 2x2x2: both losses match the reference, and LARS's
    momentum trace after step 1 (= the trust-ratio-scaled update) matches too."""
    steps, ref = lab.steps((2, 2, 2), optim, 2), lab.ref_steps(optim, 2)
    for k in range(2):
        assert_loss_close(steps[k][1]["loss"], ref[k]["loss"], f"{optim} step {k + 1}")
    if optim == "lars":
        got = sgd_trace(steps[0][0].opt_state)
        want = find_state(ref[0]["opt_state"], "TraceState").trace
        assert_trees_close(got, want, TRUST_TOL, "lars trace")


# --------------------------------------------------------------------------------------------
# 9. Mixed precision in the engine.
# --------------------------------------------------------------------------------------------
# bfloat16 compute vs the float32 reference: a bfloat16 forward rounds every activation to
# 8 bits of mantissa; measured relative loss difference 3e-6 at init (the loss is dominated
# by log(V) and the logits are small). Stated bound 1e-3 (~ 2**-10).
BF16_LOSS_RTOL = 1e-3


def test_bfloat16_master_weights_step(lab):
    """precision.params/compute bfloat16 with bfloat16 master weights (stochastic rounding)
    and dynamic loss scaling on 2x2x2: the state holds bfloat16 params, the first loss is
    the float32 reference's to bfloat16 accuracy, the loss scale is reported, nothing is
    skipped, every parameter stays finite and the step moves the weights."""
    prec = (
        "precision.params=bfloat16",
        "precision.compute=bfloat16",
        "precision.master=same-as-params",
        "precision.loss_scale=dynamic",
    )
    cfg = lab.cfg((2, 2, 2), "adamw", *prec)
    engine, state = build_engine(cfg, lab.mesh_for(cfg))
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    old = leaves(state.params)
    new, metrics = engine.train_step(state, put(engine, batch(0)))
    ref_loss = float(lab.ref_steps("adamw")[0]["loss"])
    err = abs(float(metrics["loss"]) - ref_loss) / ref_loss
    record("loss bfloat16 vs float32 reference", err)
    assert err <= BF16_LOSS_RTOL
    assert float(metrics["loss_scale"]) == cfg.precision.loss_scale_init
    assert int(metrics["skipped_steps"]) == 0
    moved = 0
    for k, v in leaves(new.params).items():
        assert v.dtype == jnp.bfloat16 and np.all(np.isfinite(v.astype(np.float32))), k
        moved += int(np.sum(v != old[k]))
    assert moved > 0.5 * sum(v.size for v in old.values())


def test_float16_overflow_skips_step(lab):
    """float16 compute with a loss scale of 2**40: the scaled gradients overflow float16, so
    the step is skipped: params and optax state bit-identical, `skipped_steps` 1, the scale
    halved for the next step, and no NaN reaches the weights."""
    prec = (
        "precision.params=float16",
        "precision.compute=float16",
        "precision.loss_scale=dynamic",
        f"precision.loss_scale_init={2.0**40}",
    )
    cfg = lab.cfg((2, 2, 2), "adamw", *prec)
    engine, state = build_engine(cfg, lab.mesh_for(cfg))
    old_params, old_tx = leaves(state.params), leaves(state.opt_state.tx)
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    new, metrics = engine.train_step(state, put(engine, batch(0)))
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**40
    assert float(new.opt_state.loss_scale.scale) == 2.0**39 and int(new.step) == 1
    for k, v in leaves(new.params).items():
        np.testing.assert_array_equal(v, old_params[k], err_msg=k)
    for k, v in leaves(new.opt_state.tx).items():
        np.testing.assert_array_equal(v, old_tx[k], err_msg=k)
    assert np.isfinite(float(metrics["loss"]))


# --------------------------------------------------------------------------------------------
# 6. Serialised sequence (`model.sequence_chunks`): attention queries, MLP tokens, loss head.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_sequence_chunks_are_the_same_math(causal):
    """Attention over 4 query blocks (lax.map, each a checkpoint) == one block: outputs and
    gradients (w.r.t. weights and input) of a single layer, float32, to rounding."""
    from jaxpod.models.layers import SelfAttention

    x = jax.random.normal(jax.random.key(1), (2, 16, 32))

    def value_and_grads(chunks):
        layer = SelfAttention(32, 4, rngs=nnx.Rngs(0), causal=causal, chunks=chunks)
        graphdef, params = nnx.split(layer)
        params = nnx.to_pure_dict(params)
        fn = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, None)))
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(params, x)

    (want, want_grads), (got, got_grads) = value_and_grads(1), value_and_grads(4)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_trees_close(got_grads, want_grads, GRAD_TOL, f"sequence chunks causal={causal}")


def test_sequence_chunks_sharded_match_reference(lab):
    """A 2x2x2 step with model.sequence_chunks=4 gives the plain (unchunked, single-device)
    reference's loss and gradients."""
    cfg = lab.cfg((2, 2, 2), "adamw", "model.sequence_chunks=4")
    loss, grads = sharded_loss_and_grads(lab, cfg)[:2]
    ref = lab.ref_steps("adamw")[0]
    assert_loss_close(loss, ref["loss"], "sequence chunks 2x2x2 vs reference")
    assert_trees_close(grads, ref["grads"], GRAD_TOL, "sequence chunks 2x2x2 vs reference")


# --------------------------------------------------------------------------------------------
# 7. Sequence parallelism (`model.sequence_parallel`).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 2, 2)], ids=mesh_id)
def test_sequence_parallel_matches_reference(lab, shape):
    """With the residual stream split over `tensor` along the sequence (all-gather before
    the column-parallel matmuls, reduce-scatter after the row-parallel ones, positions and
    targets sliced to match), loss and every gradient equal the plain reference — the
    accumulation loop (pipeline 1) and the GPipe scan (pipeline 2; BERT's test adds 1x2x4)."""
    cfg = lab.cfg(shape, "adamw", "model.sequence_parallel=true")
    loss, grads, _, mesh = sharded_loss_and_grads(lab, cfg)
    ref = lab.ref_steps("adamw")[0]
    assert_loss_close(loss, ref["loss"], f"sequence parallel {mesh_id(shape)} vs reference")
    assert_trees_close(grads, ref["grads"], GRAD_TOL, f"sequence parallel {mesh_id(shape)}")

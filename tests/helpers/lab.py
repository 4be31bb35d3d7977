"""The equivalence lab: the engine on (replica, pipeline, tensor) meshes against the plain model.

The *reference* is computed the plain way, on one device, with no shard_map, no pipeline and no
micro-batching: `model = build_model(cfg.model, seed)`, `jax.value_and_grad` of
`nnx.merge(graphdef, params)(tokens)` over the whole global batch, then the same optax chain
from `make_optimizer`. The engine runs the same config on meshes of 1-8 virtual CPU devices.
`Lab` builds each mesh's engine, its steps and the reference once per test process (the
session-scoped `lab` fixture of tests/conftest.py); the modules that use it are
tests/engine/test_mesh_equivalence.py, test_pipeline_equivalence.py,
test_engine_precision.py, tests/optim/test_trust_ratio_sharded.py and
tests/parallel/test_remat.py.

Errors are measured per leaf as max|got - want| / max|want| ("leaf-relative") unless stated.
Run with `-s` to see every measured error (printed when the session ends).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.engine import abstract_engine, build_engine
from jaxpod.models.family import build_model
from jaxpod.models.params import masks
from jaxpod.optim.chains import make_optimizer

# --------------------------------------------------------------------------------------------
# Tolerances. Everything is fp32; the mesh only changes the order of summation (psums of
# partial dots / partial batch sums, micro-batch accumulation, the pipeline's reduce-scatter),
# so differences are rounding noise. Each constant is 2-7x the largest error measured over
# all meshes and both optimizers (run with -s to print them; measured on XLA:CPU).
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

# The xdist group (tests/conftest.py) of the modules that use the lab, and of those that compile
# one of its programs under their own names: one process builds each engine and reference once.
LAB_GROUP = "shared:lab"
# Those modules' mark (`pytestmark = LAB_PROCESS`).
LAB_PROCESS = pytest.mark.xdist_group(LAB_GROUP)

# Meshes whose lab engines pre-fill the pipeline carry with NaN, so that their train steps
# (test_mesh_equivalence.py) also prove that no bubble reaches a loss, gradient or parameter:
# four stages here (two: tests/engine/test_pipeline_equivalence.py). The others keep the
# default fill, so that their programs are those other modules compile for the same configs.
NAN_FILLED = {(1, 4, 2)}

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


def print_measured() -> None:
    """The largest error `record`ed of each kind (seen with `-s`)."""
    print("\nmeasured maxima:")
    for k, v in sorted(MEASURED.items()):
        print(f"  {k}: {v:.3e}")


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
        """(cfg, mesh, engine, initial state); the state is never donated (use copies). The
        engines of `NAN_FILLED` meshes start their pipeline carry as NaN."""

        def build():
            cfg = self.cfg(shape, optim)
            mesh = self.mesh_for(cfg)
            fill = float("nan") if shape in NAN_FILLED else 0.0
            engine, state = build_engine(cfg, mesh, bubble_fill=fill)
            return cfg, mesh, engine, state

        return self.memo(("engine", shape, optim), build)

    def steps(self, shape, optim, n: int):
        """[(new_state, metrics)] after each of n train steps on batch(0), batch(1), ...; the
        steps already taken for a smaller n are continued, not repeated."""
        cfg, mesh, engine, state = self.engine(shape, optim)
        out = self.memo(("steps", shape, optim), list)
        while len(out) < n:
            k = len(out)
            state = copy_tree(out[-1][0] if out else state)
            state, metrics = engine.train_step(state, put(engine, batch(k)))
            out.append((copy_tree(state), jax.device_get(metrics)))
        return out[:n]

    def reference(self):
        """The plain single-device model: (graphdef, initial params, jitted value_and_grad)."""

        def build():
            cfg = self.cfg((1, 1, 1))
            model = build_model(cfg.model, cfg.train.seed)
            graphdef, state = nnx.split(model)
            loss_fn = lambda p, tokens: nnx.merge(graphdef, p)(tokens)
            return graphdef, nnx.to_pure_dict(state), jax.jit(jax.value_and_grad(loss_fn))

        return self.memo("reference", build)

    def ref_loss_and_grads(self):
        """(loss, grads) of the plain model on batch(0), from its initial params (step 0 of
        every `ref_steps`; no optimizer compiled)."""
        _, params, loss_and_grads = self.reference()
        return self.memo("reference step 0", lambda: loss_and_grads(params, batch(0)))

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
                    loss, grads = self.ref_loss_and_grads()
                else:
                    loss, grads = loss_and_grads(params, batch(k))
                new, opt_state, updates = update(grads, opt_state, params)
                step = dict(loss=loss, grads=grads, params=new, opt_state=opt_state)
                out.append(dict(step, updates=updates, old_params=params))
                params = new
            return out

        return self.memo(("ref_steps", optim, n), run)


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


def at_reference_params(lab, cfg, *, bubble_fill=0.0):
    """(engine, params): cfg's engine built from abstract shapes (no init program compiled)
    and the lab's reference initial params put in its shardings."""
    engine, state = abstract_engine(cfg, lab.mesh_for(cfg), bubble_fill=bubble_fill)
    shardings = jax.tree.map(lambda a: a.sharding, state.params)
    return engine, jax.device_put(lab.reference()[1], shardings)


def sharded_loss_and_grads(lab, cfg, *, bubble_fill=0.0):
    """(loss, grads, specs, mesh): `engine.loss_and_grads` on cfg's mesh at the reference's
    initial params (`at_reference_params`), on batch(0) (the reference's first batch)."""
    engine, params = at_reference_params(lab, cfg, bubble_fill=bubble_fill)
    loss, _, grads = jax.jit(engine.loss_and_grads)(params, put(engine, batch(0)))
    return loss, grads, engine.stages.specs, engine.stages.mesh

"""A fact about XLA:CPU's compiled train step that the planner's byte model does not count
(docs/memory.md, "Known under-count"): the donated optimizer state is copied whole. The
cause is the guard (`jaxpod.optim.guarded`): `where(finite, new, old)` writes each new moment
over its donated buffer, while the parameters' update, fused apart, recomputes the new
moment from the old one; nothing orders the two readers, so XLA keeps the old moment in a
copy. Without the guard there is no copy (the update then reads the written moment), and
none with the step skipped by a `lax.cond` instead (a trial, not adopted yet:
docs/benchmarks.md, "The guard as a cond"). Where the scheduler places the copies decides
how long they live: in bench_schedules' cells (read with benchmarks/xla_peak.py) they precede
the tick loops and are alive through the backward pass; the printed HLO's order is not the
schedule, so this test checks the copies' bytes only.
"""

from __future__ import annotations

import math
import re

import pytest

from jaxpod.planner.plan import plan

pytestmark = pytest.mark.engine  # compiles whole train steps: `make test` only

SMALL = ["model.d_model=128", "model.d_ff=512", "model.seq_len=128", "model.layers=4"]
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
PARAM = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\S* parameter\(\d+\).*?op_name=\"([^\"]+)\"")


def optimizer_copies(hlo: str) -> int:
    """Bytes of the entry computation's copies of optimizer-state parameters."""
    entry = hlo[hlo.index("ENTRY") :]
    moments = {
        name: BYTES[dtype] * math.prod(int(n) for n in shape.split(",") if n)
        for name, dtype, shape, op in PARAM.findall(entry)
        if "opt_state.tx" in op and shape
    }
    copies = re.findall(r"copy\(%(\S+?)\)", entry)
    return sum(moments[name] for name in copies if name in moments)


@pytest.mark.parametrize(
    "mesh, more",
    [((1, 2, 1), []), ((1, 2, 1), ["train.pipeline_schedule=1f1b"]), ((2, 1, 1), [])],
    ids=["gpipe-1x2x1", "1f1b-1x2x1", "replicas-2x1x1"],
)
def test_cpu_copies_the_whole_optimizer_state(mesh, more, tiny_cfg, mesh_for):
    from jaxpod.run.aot import abstract_inputs, compile_to_inspect

    cfg = tiny_cfg(*SMALL, "model.remat=full", "train.grad_accum=4", *more, mesh=mesh)
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    hlo = compile_to_inspect(engine.train_step.lower(state, batch)).as_text()
    copied = optimizer_copies(hlo)
    optimizer = plan(cfg)["bytes_per_device"]["optimizer"]
    print(f"{mesh} {more}: copies {copied / 1e6:.2f} MB, optimizer {optimizer / 1e6:.2f} MB")
    assert copied == pytest.approx(optimizer, rel=0.01)


def _copied_moments(guard: str) -> int:
    """Copies of donated [512, 512] state in optax AdamW's jitted step: unguarded (`""`),
    guarded by `where(finite, new, old)` over the new params and moments (`"select"`), or
    by a `lax.cond` on `finite` that returns the old ones (`"cond"`)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxpod.run.aot import compile_to_inspect

    opt = optax.adamw(1e-3)
    params = {"w": jnp.zeros((512, 512))}

    def update(p, s, g):
        updates, new_s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), new_s

    def step(p, s, g):
        ok = jnp.isfinite(optax.tree.norm(g))
        if guard == "cond":
            return jax.lax.cond(ok, update, lambda p, s, g: (p, s), p, s, g)
        new_p, new_s = update(p, s, g)
        if guard == "select":
            new_p, new_s = (jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
                            for new, old in ((new_p, p), (new_s, s)))  # fmt: skip
        return new_p, new_s

    step = jax.jit(step, donate_argnums=(0, 1))
    hlo = compile_to_inspect(step.lower(params, opt.init(params), params)).as_text()
    return len(re.findall(r"= f32\[512,512\]\S* copy\(", hlo[hlo.index("ENTRY") :]))


def test_the_guard_is_why_the_moments_are_copied():
    """AdamW's two moments are copied only when the update is guarded by a select; a guard
    that skips the update with a `lax.cond` copies nothing."""
    copies = {guard: _copied_moments(guard) for guard in ("", "select", "cond")}
    assert copies == {"": 0, "select": 2, "cond": 0}

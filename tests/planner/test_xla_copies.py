"""The compiled train step writes the donated optimizer state in place: no copy of it.

The guard (`jaxpod.optim.guarded`) skips a non-finite step. Written as `where(finite, new, old)`
over the whole trees, it makes XLA:CPU copy every donated optimizer-state leaf (the select
writes each new moment over its buffer, while the parameters' update, fused apart, recomputes
the new moment from the old one, so XLA keeps the old one in a copy): a whole extra optimizer
state alive from before the tick loops to the update (docs/memory.md, "The guard's copies"). So
`whole_tree` skips the step with a `lax.cond`; these tests find no copy of any optimizer-state
parameter in the compiled step, and pin the cause on a plain optax AdamW step.
"""

from __future__ import annotations

import math
import re

import pytest
from helpers import PLANNER_GPT, SMALL_GPT, compiled_step_once

from jaxpod.planner.plan import plan

# compiles whole train steps (`make test` only), test_plan_vs_xla.py's and test_transfers.py's
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group(PLANNER_GPT)]

RTS4 = ["memory.rts=4", "memory.rts_optimizer=4"]


BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
PARAM = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\S* parameter\(\d+\).*?op_name=\"([^\"]+)\"")


def optimizer_bytes(hlo: str) -> tuple[int, int]:
    """Bytes of the entry computation's optimizer-state parameters, and of their copies."""
    entry = hlo[hlo.index("ENTRY") :]
    moments = {
        name: BYTES[dtype] * math.prod(int(n) for n in shape.split(",") if n)
        for name, dtype, shape, op in PARAM.findall(entry)
        if "opt_state.tx" in op and shape
    }
    copies = re.findall(r"copy\(%(\S+?)\)", entry)
    return sum(moments.values()), sum(moments[name] for name in copies if name in moments)


# Remat full, GA 4 unless stated. The GPipe and RTS programs are tests/planner/
# test_plan_vs_xla.py's (test_skipped_bubbles_hold_one_ticks_gradients_more's plain step, the
# XLA case 4x1x1-full-ga2-rts4) and the replicas one test_transfers.py's: the session's
# compilation cache compiles each once.
RTS_CASE = ((4, 1, 1), [*RTS4, "train.grad_accum=2"])


@pytest.mark.parametrize(
    "mesh, more",
    [
        ((1, 2, 1), ["train.grad_accum=8"]),
        ((1, 2, 1), ["train.pipeline_schedule=1f1b"]),
        ((2, 1, 1), []),
        RTS_CASE,
    ],
    ids=["gpipe-ga8-1x2x1", "1f1b-1x2x1", "replicas-2x1x1", "rts4-ga2-4x1x1"],
)
def test_the_optimizer_state_is_updated_in_place(mesh, more, tiny_cfg, mesh_for):
    cfg = tiny_cfg(*SMALL_GPT, "model.remat=full", "train.grad_accum=4", *more, mesh=mesh)
    hlo = compiled_step_once(cfg, mesh_for).as_text()
    state_bytes, copied = optimizer_bytes(hlo)
    optimizer = plan(cfg)["bytes_per_device"]["optimizer"]
    print(f"{mesh} {more}: state {state_bytes / 1e6:.2f} MB, copies {copied / 1e6:.2f} MB")
    assert state_bytes == pytest.approx(optimizer, rel=0.01)  # the parameters were found
    assert copied == 0


def _copied_moments(guard: str) -> int:
    """Copies of donated [512, 512] state in optax AdamW's jitted step: unguarded (`""`),
    guarded by `where(finite, new, old)` over the new params and moments (`"select"`), or
    by a `lax.cond` on `finite` that returns the old ones (`"cond"`)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxpod.inspect.compile import compile_to_inspect

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
            new_p, new_s = (
                jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
                for new, old in ((new_p, p), (new_s, s))
            )
        return new_p, new_s

    step = jax.jit(step, donate_argnums=(0, 1))
    hlo = compile_to_inspect(step.lower(params, opt.init(params), params)).as_text()
    return len(re.findall(r"= f32\[512,512\]\S* copy\(", hlo[hlo.index("ENTRY") :]))


def test_the_guard_is_why_the_moments_are_copied():
    """AdamW's two moments are copied only when the update is guarded by a select; a guard
    that skips the update with a `lax.cond` copies nothing."""
    copies = {guard: _copied_moments(guard) for guard in ("", "select", "cond")}
    assert copies == {"": 0, "select": 2, "cond": 0}


def test_a_whole_weight_gradient_is_transposed_before_its_reduce_scatter(tiny_cfg, mesh_for):
    """With RTS each gathered matrix's gradient is a whole dot output, reduce-scattered to the
    replica's shard; `W_in`'s ([d, d_ff], split along d_ff) is first copied into the transposed
    layout. The planner's `scattered` is that gradient and its copy, less the gathered MLP
    matrix the backward no longer holds (jaxpod.planner.bytes). (RTS 4 on 4x1x1, GA 2: the
    program `test_the_optimizer_state_is_updated_in_place[rts4-ga2-4x1x1]` reads.)"""
    mesh, more = RTS_CASE
    cfg = tiny_cfg(*SMALL_GPT, "model.remat=full", "train.grad_accum=4", *more, mesh=mesh)
    hlo = compiled_step_once(cfg, mesh_for).as_text()
    dots = set(re.findall(r"%(\S+) = f32\[128,512\]\{1,0\} dot\(", hlo))
    copies = {
        name
        for name, operand in re.findall(r"%(\S+) = f32\[128,512\]\{0,1\} fusion\(%(\S+?)\)", hlo)
        if operand in dots
    }
    scattered = re.findall(r"= f32\[128,128\]\{0,1\} reduce-scatter\(%(\S+?)\)", hlo)
    assert any(name in copies for name in scattered), "no transposed gradient is reduce-scattered"
    planned = plan(cfg)["bytes_per_device"]["scattered"]
    assert planned == 2 * 128 * 512 * 4 - 128 * 512 * 4

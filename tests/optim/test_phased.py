"""The update in phases (`jaxpod.optim.phased.in_phases`) against the whole-tree update, on
one device: the same params, optimizer state, update norm and param norm, for an optimizer
that works per element (AdamW) and one whose trust ratios are per layer (LARS)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_tiny_cfg

from jaxpod.optim.chains import make_optimizer
from jaxpod.optim.guarded import guarded_update, whole_tree
from jaxpod.optim.per_layer import per_layer
from jaxpod.optim.phased import in_phases, state_owners
from jaxpod.optim.precision import init_loss_scale, sum_squares

LAYERS = 4
STACKED = {"layers": {"w": True, "b": True}, "wte": False}
DECAY = {"layers": {"w": True, "b": False}, "wte": True}


def _tree(rng: np.random.Generator, scale: float) -> dict:
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)  # noqa: E731
    return {"layers": {"w": draw(LAYERS, 8, 16), "b": draw(LAYERS, 16)}, "wte": draw(32, 8)}


def _update(name: str, phases: int | None, layered: bool = False):
    """Two steps of the guarded update (the second with the first's state), whole or in
    `phases` of `whole_tree` (`layered`: of `per_layer`, tensor by tensor): `(params,
    optimizer state, infos, param_sq of each step or None)`."""
    cfg = make_tiny_cfg(f"optim.name={name}", "optim.warmup_steps=0", "optim.grad_clip=0.5")
    optimizer, _ = make_optimizer(cfg.optim, 10, decay_mask=DECAY, stacked_mask=STACKED, clip=False)
    rng = np.random.default_rng(3)
    params = _tree(rng, 1.0)
    state, scale = optimizer.init(params), init_loss_scale(cfg.precision)
    infos, norms_seen = [], []
    for step in range(2):
        grads, norms = _tree(rng, 0.1), {}
        apply = whole_tree(optimizer)
        if layered:
            apply = per_layer(optimizer, STACKED, stages=1, min_strip=64)[1]
        if phases is not None:  # the matrices by phase, the biases with the other leaves
            matrices = jax.tree.map(lambda s, d: s and d, STACKED, DECAY)
            same = lambda new, old: new  # noqa: E731  one memory: nothing to put back
            apply = in_phases(
                apply, optimizer, matrices, phases, fetch=lambda x: x, store=same, norms=norms
            )
        key = jax.random.key(step)
        params, state, scale, info = guarded_update(
            apply, grads, state, params, scale, key, cfg.precision, max_norm=cfg.optim.grad_clip
        )
        infos.append(info)
        norms_seen.append(norms.get("param_sq"))
    return params, state, infos, norms_seen


@pytest.mark.parametrize("phases", [2, 4])
@pytest.mark.parametrize(
    ("name", "layered"),
    [("adamw", False), ("lars", False), ("lars", True)],
    ids=["adamw", "lars", "lars-per-layer"],
)
def test_the_update_in_phases_is_the_whole_update(name, layered, phases):
    """Whole-tree, and `per_layer` (the 16-bit masters' update, here on float32 so that
    it rounds nothing) with its strips, in phases against the same update in one part."""
    params, state, infos, _ = _update(name, None, layered)
    p_phased, s_phased, i_phased, param_sq = _update(name, phases, layered)
    # the same arithmetic on the same values, on arrays of other shapes (XLA's vectorised
    # loops round some products apart from others: measured at most 1.5 ulp of the leaf's
    # largest value, tolerated 2)
    leaves = zip(
        jax.tree.leaves((p_phased, s_phased)), jax.tree.leaves((params, state)), strict=True
    )
    for got, want in leaves:
        got, want = np.asarray(got), np.asarray(want)
        ulp = np.spacing(np.float32(np.max(np.abs(want)))) if want.size else 0
        apart = np.max(np.abs(got - want), initial=0) / max(ulp, 1e-30)
        print(f"{name} phases {phases}: {apart:.2f} ulp")
        np.testing.assert_allclose(got, want, rtol=0, atol=2 * ulp)
    for got, want, sq in zip(i_phased, infos, param_sq, strict=True):
        assert bool(got["finite"]) and bool(want["finite"])
        # sums over the same elements in another order: float32 rounding of a sum of squares
        np.testing.assert_allclose(got["update_sq"], want["update_sq"], rtol=1e-6)
        assert sq is not None
    np.testing.assert_allclose(param_sq[-1], sum_squares(params), rtol=1e-6)


def test_state_owners_name_each_moment_and_the_step_counts():
    cfg = make_tiny_cfg("optim.name=adamw")
    optimizer, _ = make_optimizer(cfg.optim, 10, decay_mask=DECAY, stacked_mask=STACKED, clip=False)
    params = _tree(np.random.default_rng(0), 1.0)
    owners = state_owners(optimizer, optimizer.init(params), params)
    # Adam's two moments of each of the 3 leaves, and its step count(s)
    assert sorted(o for o in owners if o >= 0) == [0, 0, 1, 1, 2, 2]
    assert owners.count(-1) >= 1

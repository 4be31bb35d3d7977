"""Checkpoints in process (`jaxpod.run.checkpoint`): a state saved on one mesh is restored into
another mesh's shardings (through the CLI: tests/cli/test_checkpoint_cli.py)."""

from __future__ import annotations

import numpy as np
import pytest


def assert_restored(restored, want, engine) -> None:
    """Every leaf of `restored` in the engine's sharding and equal to `want`'s, bit for bit."""
    import jax

    leaves = zip(*map(jax.tree.leaves, (restored, want, engine.state_sharding)), strict=True)
    for got, expected, sharding in leaves:
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def shifted(state):
    """Every leaf of `state` plus one, in its own sharding (memory kind included): a state no
    engine initialises, so a restore that returned its template could not pass."""
    import jax

    return jax.tree.map(lambda a: jax.device_put(np.asarray(a) + 1, a.sharding), state)


def scrambled(state, seed: int = 0):
    """Every float leaf of `state` plus distinct random values (integer leaves plus one), in
    its own sharding: no two layers of a stacked leaf, params or optimizer moments, alike."""
    import jax

    rng = np.random.default_rng(seed)

    def leaf(a):
        x = np.asarray(a)
        floating = np.issubdtype(x.dtype, np.floating)
        x = x + (rng.standard_normal(x.shape).astype(x.dtype) if floating else 1)
        return jax.device_put(x, a.sharding)

    return jax.tree.map(leaf, state)


@pytest.fixture(scope="module")
def built(tiny_cfg, mesh_for):
    """`built(*overrides, mesh=(r, p, t)) -> (cfg, engine, initial state)`, each config built
    once in this module (its tests read the states, never donate them)."""
    from jaxpod.engine import build_engine

    memo = {}

    def build(*overrides, mesh):
        key = (overrides, mesh)
        if key not in memo:
            cfg = tiny_cfg(*overrides, mesh=mesh)
            memo[key] = (cfg, *build_engine(cfg, mesh_for(cfg)))
        return memo[key]

    return build


BATCH = ("train.global_batch=16", "train.grad_accum=null")
CIRCULAR = ("train.pipeline_schedule=circular", "train.virtual_stages=2")


def test_restore_reads_into_the_new_meshs_shardings(built, tmp_path):
    """In process: saved from 2x2x2, restored on 1x2x4 with exactly the engine's shardings."""
    import jax

    from jaxpod.run.checkpoint import Checkpointer

    saved = shifted(built(*BATCH, mesh=(2, 2, 2))[2])
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, saved, seed=0)
    _, engine, fresh = built(*BATCH, mesh=(1, 2, 4))
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(saved), strict=True):
        assert not np.array_equal(np.asarray(a), np.asarray(b))  # the template is not the answer
    ckpt = Checkpointer(tmp_path, keep=1)
    assert ckpt.latest_step() == 1
    restored = ckpt.restore(1, engine, fresh, seed=0)
    ckpt.close()
    assert_restored(restored, saved, engine)


INITS = {"init_params", "init_rows"}  # the jitted inits of stacked and packed stages


def test_a_resume_restores_without_initialising(built, tiny_cfg, mesh_for, tmp_path):
    """`run_training` on a run directory with a checkpoint builds the state from abstract
    shapes and restores into it: no init program is traced, and the state it returns is the
    saved one (here a complete run, which then takes no step)."""
    import jax
    import jax.monitoring

    from jaxpod.config import config_to_dict
    from jaxpod.engine import build_engine
    from jaxpod.run.checkpoint import Checkpointer
    from jaxpod.run.loop import run_training

    cfg = tiny_cfg(*BATCH, "train.steps=1", f"train.logdir={tmp_path}", mesh=(2, 2, 2))
    saved = shifted(built(*BATCH, mesh=(2, 2, 2))[2])
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, saved, seed=cfg.train.seed, config=config_to_dict(cfg))
    traced, recording = [], [True]

    def listen(event: str, seconds: float, fun_name: str | None = None, **_) -> None:
        if recording[0] and event.endswith("jaxpr_trace_duration"):
            traced.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = run_training(cfg, quiet=True)
        resumed, traced[:] = list(traced), []
        build_engine(cfg, mesh_for(cfg))  # a fresh state: its init program is traced
    finally:
        recording[0] = False
    assert INITS & set(traced) and not INITS & set(resumed)
    assert result.losses == []
    assert_restored(result.state, saved, built(*BATCH, mesh=(2, 2, 2))[1])


def test_one_process_writes_each_shard_whole(built, tmp_path, monkeypatch):
    """orbax's replica-parallel saving splits each replicated shard between its replicas, an
    eager `slice_in_dim` (an XLA compile) per slice; in one process each shard is written whole
    from one replica. Checked on 2x2x2 against orbax's default handler, which does slice."""
    import jax
    import orbax.checkpoint as ocp

    from jaxpod.run import checkpoint
    from jaxpod.run.checkpoint import Checkpointer

    _, _, state = built(*BATCH, mesh=(2, 2, 2))
    slices = []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(a) or real(*a, **k))

    def save(name: str) -> int:
        (tmp_path / name).mkdir()
        with Checkpointer(tmp_path / name, keep=1) as ckpt:
            ckpt.save(1, state, seed=0)
        return len(slices)

    assert save("whole") == 0
    default = ocp.type_handlers.ArrayHandler()
    ocp.type_handlers.register_type_handler(jax.Array, default, override=True)
    try:
        monkeypatch.setattr(checkpoint, "_HANDLER_SET", True)  # keep orbax's default
        assert save("replica-parallel") > 0
    finally:
        monkeypatch.setattr(checkpoint, "_HANDLER_SET", False)
        checkpoint._register_array_handler()  # this process's handler again


@pytest.mark.parametrize(
    "direction",
    [
        "circular-to-gpipe",
        "gpipe-to-circular",
        "circular-to-gpipe-on-host",
    ],
)
def test_a_resume_with_another_layer_order_restores_the_same_model(built, tmp_path, direction):
    """A circular schedule stores its layers in virtual-stage order
    (`StackedStages.layer_order`), which changes with train.virtual_stages and mesh.pipeline,
    both free to change on resume. The saved state is the init plus one (`shifted`); restored
    in the other order it is what a fresh engine of the restoring config initialises (the
    values depend only on the seed) plus one: every layer in place. Layers kept in host
    memory (offloaded, RTS 2) are moved there too."""
    import jax

    from jaxpod.config import config_to_dict
    from jaxpod.run.checkpoint import Checkpointer

    common = BATCH
    if direction.endswith("on-host"):
        common += ("memory.offload=[optimizer,params]", "memory.rts=2")
    configs = [((*common, *CIRCULAR), (2, 2, 2)), (common, (2, 2, 1))]
    saving, restoring = configs[::-1] if direction == "gpipe-to-circular" else configs
    saving, saver, saved = built(*saving[0], mesh=saving[1])
    assert (saver.stages.layer_order is None) == (direction == "gpipe-to-circular")
    with Checkpointer(tmp_path, keep=1) as ckpt:
        config = config_to_dict(saving)
        ckpt.save(1, shifted(saved), seed=0, config=config, layer_order=saver.stages.layer_order)
    _, engine, fresh = built(*restoring[0], mesh=restoring[1])
    with Checkpointer(tmp_path, keep=1) as ckpt:
        restored = ckpt.restore(1, engine, fresh, seed=0)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(restored)}
    assert ("pinned_host" in kinds) == direction.endswith("on-host")
    assert_restored(restored, shifted(fresh), engine)


def test_the_optimizer_moments_move_with_their_layers(built, tmp_path):
    """A circular state with non-zero optimizer moments, restored under GPipe: every stacked
    leaf of the params and the optimizer state is the saved one in logical order, the rest as
    saved. The saved state is the initial one with every element moved by its own random
    amount (`scrambled`): no two layers alike, so any misplaced layer of any leaf shows (what
    is read and moved is the checkpoint, not how a step computed it)."""
    import jax

    from jaxpod.models.params import in_stack
    from jaxpod.run.checkpoint import Checkpointer

    _, saver, state = built(*BATCH, *CIRCULAR, mesh=(2, 2, 2))  # the engines of the test above
    state = scrambled(state)
    order = saver.stages.layer_order
    assert list(order) != sorted(order)  # stored out of logical order: moving them shows
    saved = jax.device_get(state)
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, state, seed=0, layer_order=order)
    _, engine, fresh = built(*BATCH, mesh=(2, 2, 1))
    with Checkpointer(tmp_path, keep=1) as ckpt:
        restored = jax.device_get(ckpt.restore(1, engine, fresh, seed=0))

    def logical(path, leaf):
        return leaf[np.argsort(order)] if in_stack(path) else leaf

    want = jax.tree_util.tree_map_with_path(logical, saved)
    moments = [a for a in jax.tree.leaves(restored.opt_state.tx) if a.ndim and a.shape[0] == 4]
    assert moments and all(np.any(a != 0) for a in moments)
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_long_storage_error_keeps_the_operating_systems_reason():
    """orbax joins the errors of many writes into one message whose end is a list: the one
    line still names the reason (`tests/cli/test_resume_cli.py` provokes the real one)."""
    import logging

    from jaxpod.run.checkpoint import _reraised, _why

    write = "Failed to write 568606 bytes to file 12: File too large [os_error_code='27']"
    many = ValueError(f'OUT_OF_RANGE: Error writing "mu/3.0.0": {write}' + " x" * 150 + "}'])")
    assert _why(many).startswith("ValueError: OUT_OF_RANGE: Error writing")
    assert _why(many).endswith("... File too large")
    assert _why(ValueError("short")) == "ValueError: short"
    # the reason comes from the error number, not from the words around it
    for code in ("[os_error_code='27']", "[os_error_code=\\'27\\']", "[os_error_code=27]"):
        bare = ValueError(f"OUT_OF_RANGE: Failed to write: {code}" + " x" * 150)
        assert _why(bare).endswith("... File too large"), code
    # or, without the number, from its wording, wherever it is in the message
    wording = f"UNKNOWN: commit failed: {write.split(' [')[0]}" + " x" * 100 + " [at f.cc:327']"
    assert _why(ValueError(wording)).endswith("... File too large")
    # asyncio's report of an orbax write nobody awaited is dropped; other logs are kept
    try:
        raise ValueError(write)
    except ValueError as e:
        info = (ValueError, e, e.__traceback__)
    unretrieved = "Task exception was never retrieved\nfuture: <Task coro=<.../orbax/x.py>>"
    record = logging.LogRecord(
        "asyncio", logging.ERROR, "base_events.py", 1, unretrieved, None, info
    )
    assert not _reraised(record)
    other = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "other", None, info)
    assert _reraised(other)


def test_rotation_moves_a_checkpoint_out_whole_before_removing_it(tmp_path):
    """With `keep=1`, saving step 2 rotates step 1 out: orbax renames it into `deleting/` in
    one step (its files all there, no step of that name left), and the next save or the close
    removes it. An interrupted run's leftovers there are removed when a run opens the
    directory; they are never listed as a step."""
    import jax.numpy as jnp

    from jaxpod.run.checkpoint import DELETING, Checkpointer

    state = {"step": jnp.int32(1), "params": {"w": jnp.arange(64.0).reshape(8, 8)}}
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, seed=0)
    ckpt._manager.wait_until_finished()
    files = sorted(p.relative_to(root / "1") for p in (root / "1").rglob("*"))
    ckpt.save(2, state, seed=0)
    ckpt._manager.wait_until_finished()  # step 2 committed, step 1 rotated out
    assert not (root / "1").exists()
    moved = root / DELETING / "1"
    assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == files
    ckpt.save(3, state, seed=0)  # removes what the last rotation moved
    assert not moved.exists()
    ckpt.close()
    assert sorted(p.name for p in root.iterdir()) == ["3"]

    (root / DELETING / "2" / "state").mkdir(parents=True)  # a run killed while removing
    (root / DELETING / "2" / "state" / "half").write_text("x")
    reopened = Checkpointer(tmp_path, keep=1)
    assert reopened.latest_step() == 3
    assert not (root / DELETING).exists()
    reopened.close()

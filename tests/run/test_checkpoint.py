"""Checkpoints in process (`jaxpod.run.checkpoint`): a state saved on one mesh is restored into
another mesh's shardings (through the CLI: tests/cli/test_checkpoint_cli.py)."""

from __future__ import annotations

import numpy as np


def test_restore_reads_into_the_new_meshs_shardings(tiny_cfg, mesh_for, tmp_path):
    """In process: saved from 2x2x2, restored on 1x2x4 with exactly the engine's shardings."""
    import jax

    from jaxpod.engine import build_engine
    from jaxpod.run.checkpoint import Checkpointer

    batch = ["train.global_batch=16", "train.grad_accum=null"]
    old_cfg, new_cfg = tiny_cfg(*batch, mesh=(2, 2, 2)), tiny_cfg(*batch, mesh=(1, 2, 4))
    _, saved = build_engine(old_cfg, mesh_for(old_cfg))
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, saved, seed=0)
    engine, fresh = build_engine(new_cfg, mesh_for(new_cfg))
    ckpt = Checkpointer(tmp_path, keep=1)
    assert ckpt.latest_step() == 1
    restored = ckpt.restore(1, engine, fresh, seed=0)
    ckpt.close()
    for got, want, sharding in zip(
        jax.tree.leaves(restored),
        jax.tree.leaves(saved),
        jax.tree.leaves(engine.state_sharding),
        strict=True,
    ):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


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
    record = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, unretrieved,
                               None, info)  # fmt: skip
    assert not _reraised(record)
    other = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "other", None, info)
    assert _reraised(other)

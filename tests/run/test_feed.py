"""The device feed (`jaxpod.run.feed`): a host batch's copy is the batch; the next part is copied
only once the call before it is done. That a training run holds one part on the devices, each
copied after the call before it is done, is checked on the run in parts that
tests/run/test_batch_parts_run.py compares with the whole-batch run (one run, two claims)."""

from __future__ import annotations

import numpy as np

# tests/run/test_batch_parts_run.py's runs: the engines built here are the ones built there
RUN = ("train.global_batch=8", "train.grad_accum=null", "train.micro_batch=1")
RUN += ("train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2")
RUN += ("optim.warmup_steps=0", "optim.name=sgd", "optim.grad_clip=0", "data.prefetch=3")
RUN += ("model.seq_len=40",)


def test_a_host_batch_put_is_the_batch(tiny_cfg, mesh_for):
    """`Task.read` then `HostBatch.put` gives `Task.batch`'s rows, sharded as the engine's batch."""
    import jax

    from jaxpod.run.tasks import build_task

    cfg = tiny_cfg(*RUN, "train.batch_parts=2", mesh=(2, 1, 1))
    task, _ = build_task(cfg, mesh_for(cfg))
    host = task.read(3, part=1)
    assert all(isinstance(x, np.ndarray) for _, _, rows in host.arrays for x in rows.values())
    (got,) = host.put()
    (want,) = task.batch(3, part=1)
    assert got.sharding == task.engine.batch_sharding[0]
    assert got.shape == (cfg.part_batch, cfg.model.seq_len + 1)
    np.testing.assert_array_equal(jax.device_get(got), jax.device_get(want))


def test_next_waits_for_the_call_dispatched_before(tiny_cfg, mesh_for):
    """`next(feed)` returns only once the outputs given to `dispatched` are computed."""
    import jax
    import jax.numpy as jnp

    from jaxpod.run.feed import DeviceFeed
    from jaxpod.run.tasks import build_task

    cfg = tiny_cfg(*RUN, mesh=(2, 1, 1))
    task, _ = build_task(cfg, mesh_for(cfg))
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.eye(512) * 0.5
    slow(x).block_until_ready()  # compiled
    feed = DeviceFeed(task.read(i) for i in range(2))
    next(feed)
    out = slow(x)
    assert not out.is_ready()  # dispatched, still running (~40 matmuls of 512 x 512)
    feed.dispatched({"loss": out})
    next(feed)
    assert out.is_ready()

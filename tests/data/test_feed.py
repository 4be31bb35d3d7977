"""The device feed (`jaxpod.data.feed`): a host batch's copy is the batch; the next part is copied
only once the call before it is done, across the hand-offs between training and evaluation;
a step is timed once every device is done with it.
That a training run holds one part on the devices, each copied after the call before it is
done, is checked on the run in parts that tests/run/test_batch_parts_run.py compares with the
whole-batch run (one run, two claims)."""

from __future__ import annotations

import numpy as np

# tests/run/test_batch_parts_run.py's runs: the engines built here are the ones built there
RUN = ("train.global_batch=8", "train.grad_accum=null", "train.micro_batch=1")
RUN += ("train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2")
RUN += ("optim.warmup_steps=0", "optim.name=sgd", "optim.grad_clip=0", "data.prefetch=3")
RUN += ("model.seq_len=40",)


def _slow_zero(device):
    """A compiled call that keeps `device` busy (40 matmuls of 512 x 512) and returns a zero
    scalar there: `() -> jax.Array`, still running when it returns (dispatch is async)."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jnp.eye(512) * 0.5, device)
    matmuls = lambda x: jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x)  # noqa: E731
    slow = jax.jit(lambda x: 0 * jnp.sum(matmuls(x)))
    slow(x).block_until_ready()  # compiled
    return lambda: slow(x)


def _lagging_scalar(mesh):
    """`() -> jax.Array`: a replicated zero over `mesh`'s two devices, computed on the first
    when it returns and still running on the second (`jax.device_get` would return at once)."""
    import jax
    import jax.numpy as jnp

    fast_device, slow_device = mesh.devices.flat
    slow = _slow_zero(slow_device)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def lagging():
        fast = jax.device_put(jnp.zeros(()), fast_device).block_until_ready()
        return jax.make_array_from_single_device_arrays((), replicated, [fast, slow()])

    return lagging


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

    from jaxpod.data.feed import DeviceFeed
    from jaxpod.run.tasks import build_task

    cfg = tiny_cfg(*RUN, mesh=(2, 1, 1))
    task, _ = build_task(cfg, mesh_for(cfg))
    slow = _slow_zero(jax.devices()[0])
    feed = DeviceFeed(task.read(i) for i in range(2))
    next(feed)
    out = slow()
    assert not out.is_ready()  # dispatched, still running
    feed.dispatched({"loss": out})
    next(feed)
    assert out.is_ready()


def test_evaluation_runs_between_the_calls_around_it(tiny_cfg, mesh_for):
    """`Task.evaluate` copies its first part once the call that computed `params` is done, and
    returns once its own calls are done on every device: `device_get` of a replicated output
    waits for one device's copy only, so the next training part could otherwise be copied
    beside a running evaluation (device 1 runs slow here, device 0 does not)."""
    import dataclasses

    import jax

    from jaxpod.run.tasks import build_task

    cfg = tiny_cfg(*RUN, mesh=(2, 1, 1))
    mesh = mesh_for(cfg)
    task, _ = build_task(cfg, mesh)
    slow_on_device_1 = _lagging_scalar(mesh)
    params_ready, outs = [], []

    def eval_step(params, batch):
        params_ready.append(all(p.is_ready() for p in jax.tree.leaves(params)))
        outs.append(slow_on_device_1())
        return {"loss": outs[-1]}

    params = {"w": slow_on_device_1()}
    assert not params["w"].is_ready()  # the call "before" evaluation, still running
    engine = task.engine._replace(eval_step=eval_step)
    result = dataclasses.replace(task, engine=engine).evaluate(params)
    assert result == {"loss": 0.0}
    assert params_ready == [True, True]
    assert all(out.is_ready() for out in outs)


def test_a_step_is_timed_once_every_device_is_done(tiny_cfg, mesh_for):
    """The loop reads a step's metrics, and stamps its time, once every device has computed
    them, so `step_time_s` is not one device's time (device 1 runs slow here)."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from jaxpod.run.steplog import StepLog

    cfg = tiny_cfg(*RUN, mesh=(2, 1, 1))
    lagging = _lagging_scalar(mesh_for(cfg))
    task = SimpleNamespace(per_step=8, unit="tokens")
    bar = SimpleNamespace(disable=False, set_postfix=lambda **_: None)
    done_when_written, pushed = [], []

    def write(record):  # the step's record, its time stamped
        metrics = pushed[record["step"] - 1]
        done_when_written.append(all(m.is_ready() for m in metrics.values()))

    steplog = StepLog(cfg, task, SimpleNamespace(write=write), bar, print, 0, ckpt=None)
    for step in (1, 2):
        pushed.append({"loss": lagging(), "lr": jnp.zeros(())})
        assert not pushed[-1]["loss"].is_ready()  # dispatched, still running on device 1
        steplog.push(step, pushed[-1])
    steplog.flush()
    assert done_when_written == [True, True]

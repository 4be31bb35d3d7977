"""The device feed (`jaxpod.run.feed`): a host batch's copy is the batch; the next part is copied
only once the call before it is done; a training run holds one part on the devices."""

from __future__ import annotations

import numpy as np
import pytest

RUN = ("train.global_batch=8", "train.grad_accum=null", "train.micro_batch=1", "train.steps=3")
RUN += ("train.eval_every=2", "train.eval_batches=2", "optim.warmup_steps=0", "data.prefetch=3")
RUN += ("model.seq_len=40",)  # batches of a shape no other test's arrays have


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


@pytest.fixture(scope="module")
def fed_calls(tiny_cfg, tmp_path_factory):
    """A 3-step run in 4 parts, evaluated at steps 0, 2 and 3, with every jitted call of its
    engine recorded: (name, parts alive on the devices, the previous call's outputs ready)."""
    import jax

    import jaxpod.run.tasks as tasks
    from jaxpod.run.loop import run_training

    calls = []
    last = [None]
    names = ("train_step", "first_part_step", "accumulate_step", "eval_step")

    class Recorded:
        def __init__(self, name, call):
            self.name, self.call = name, call

        def __getattr__(self, attr):  # .lower for the loop's ahead-of-time compile
            return getattr(self.call, attr)

        def __call__(self, *args):
            if isinstance(args[1][0], jax.core.Tracer):  # `jax.eval_shape` of the loop's compile
                return self.call(*args)
            shape = args[1][0].shape  # the call's part (tokens)
            alive = sum(1 for x in jax.live_arrays() if x.shape == shape)
            ready = last[0] is None or all(x.is_ready() for x in jax.tree.leaves(last[0]))
            calls.append((self.name, alive, ready))
            out = self.call(*args)
            last[0] = out if self.name == "eval_step" else out[1]  # never the donated part
            return out

    def build_engine(cfg, mesh):
        engine, state = tasks_build_engine(cfg, mesh)
        return engine._replace(**{n: Recorded(n, getattr(engine, n)) for n in names}), state

    tasks_build_engine = tasks.build_engine
    logdir = tmp_path_factory.mktemp("fed")
    cfg = tiny_cfg(*RUN, "train.batch_parts=4", f"train.logdir={logdir}", mesh=(2, 1, 1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks, "build_engine", build_engine)
        run_training(cfg, quiet=True)
    return calls


@pytest.mark.long_run
def test_a_run_holds_one_part_on_the_devices(fed_calls):
    """At every call, train and eval, the only part alive is the call's own (with parts put
    ahead, a step's 4 parts and 3 prefetched ones were)."""
    names = [name for name, _, _ in fed_calls]
    assert names.count("train_step") == 3 and names.count("accumulate_step") == 6
    assert names.count("eval_step") == 3 * 2 * 4  # steps 0, 2, 3: 2 batches of 4 parts
    assert [alive for _, alive, _ in fed_calls] == [1] * len(fed_calls)


@pytest.mark.long_run
def test_each_part_is_copied_after_the_call_before_it_is_done(fed_calls):
    """When a call is dispatched, the call before it has finished (its part is freed)."""
    assert [ready for _, _, ready in fed_calls] == [True] * len(fed_calls)

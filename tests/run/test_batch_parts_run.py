"""`train.batch_parts` through the training loop (`jaxpod.run.loop`): a run fed in parts logs
the losses, validation losses and checkpoint of the run fed whole batches (the engine's step
against the whole batch: tests/engine/test_batch_parts.py), and the device feed
(`jaxpod.data.feed`) holds one part on the devices at a time (its unit tests:
tests/data/test_feed.py).

One pair of runs is shared by the module: 3 steps on 2x1x1, whole batches and in 4 parts, the
run in parts with every jitted call of its engine recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest

RUN = ("train.global_batch=8", "train.grad_accum=null", "train.micro_batch=1")
RUN += ("train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2")
PARAM_ATOL = 1e-7  # SGD steps of ~1e-3 (as tests/engine/test_batch_parts.py)
RUN += ("optim.warmup_steps=0", "optim.name=sgd", "optim.grad_clip=0", "data.prefetch=3")
RUN += ("model.seq_len=40",)  # batches of a shape no other test's arrays have


def test_the_parts_of_a_batch_are_its_rows_in_order(tiny_cfg, mesh_for):
    """The 4 parts of a train and a validation batch (`Task.batch`), put together, are the
    whole batch."""
    import jax

    from jaxpod.run.tasks import build_task

    whole_cfg = tiny_cfg(*RUN, mesh=(2, 1, 1))
    parts_cfg = tiny_cfg(*RUN, "train.batch_parts=4", mesh=(2, 1, 1))
    whole, _ = build_task(whole_cfg, mesh_for(whole_cfg))
    parts, _ = build_task(parts_cfg, mesh_for(parts_cfg))
    for step, val in [(0, False), (5, False), (1, True)]:
        (want,) = whole.batch(step, val)
        got = [parts.batch(step, val, part)[0] for part in range(4)]
        assert [g.shape for g in got] == [(2, want.shape[1])] * 4
        np.testing.assert_array_equal(np.concatenate(jax.device_get(got)), np.asarray(want))


@pytest.fixture(scope="module")
def runs(tiny_cfg, tmp_path_factory):
    """The 3-step runs, in 4 parts (first: no other run's arrays are alive) and whole, each
    as `(RunResult, logged training losses)` by parts; with the run in parts, every jitted
    call of its engine, evaluated at steps 0, 2 and 3: (name, parts alive on the devices, the
    previous call's outputs ready)."""
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
    results = {}
    for parts in (4, 1):
        logdir = tmp_path_factory.mktemp(f"parts{parts}")
        cfg = tiny_cfg(*RUN, f"train.batch_parts={parts}", f"train.logdir={logdir}", mesh=(2, 1, 1))
        with pytest.MonkeyPatch.context() as patch:
            if parts > 1:
                patch.setattr(tasks, "build_engine", build_engine)
            result = run_training(cfg, quiet=True)
        lines = (logdir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        results[parts] = (result, [r["loss"] for r in records if "loss" in r])
    return results, calls


@pytest.mark.long_run
def test_a_run_in_parts_logs_the_whole_batch_run(runs):
    """Three steps on 2x1x1, whole batches and in 4 parts (1 micro-batch each): the same
    losses and validation losses step by step, and the final parameters (the run's state)."""
    import jax

    results, _ = runs
    (whole, whole_losses), (split, split_losses) = results[1], results[4]
    assert len(whole_losses) == len(split_losses) == 3
    np.testing.assert_allclose(split.losses, whole.losses, rtol=1e-6)
    np.testing.assert_allclose(split_losses, whole_losses, rtol=1e-6)
    assert sorted(split.val_losses) == sorted(whole.val_losses) == [0, 2, 3]
    for step, loss in whole.val_losses.items():
        assert split.val_losses[step] == pytest.approx(loss, rel=1e-6)
    trees = [jax.tree.leaves(jax.device_get(r.state.params)) for r in (split, whole)]
    leaves = zip(*trees, strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=PARAM_ATOL)


@pytest.mark.long_run
def test_a_run_holds_one_part_on_the_devices(runs):
    """At every call, train and eval, the only part alive is the call's own (with parts put
    ahead, a step's 4 parts and 3 prefetched ones would be)."""
    _, fed_calls = runs
    names = [name for name, _, _ in fed_calls]
    assert names.count("train_step") == 3 and names.count("accumulate_step") == 6
    assert names.count("eval_step") == 3 * 2 * 4  # steps 0, 2, 3: 2 batches of 4 parts
    assert [alive for _, alive, _ in fed_calls] == [1] * len(fed_calls)


@pytest.mark.long_run
def test_each_part_is_copied_after_the_call_before_it_is_done(runs):
    """When a call is dispatched, the call before it has finished (its part is freed)."""
    _, fed_calls = runs
    assert [ready for _, _, ready in fed_calls] == [True] * len(fed_calls)

"""`train.batch_parts` through the training loop (`jaxpod.run.loop`): a run fed in parts logs
the losses, validation losses and checkpoint of the run fed whole batches (the engine's step
against the whole batch: tests/engine/test_batch_parts.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

RUN = ("train.global_batch=8", "train.grad_accum=null", "train.micro_batch=1")
RUN += ("train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2")
PARAM_ATOL = 1e-7  # SGD steps of ~1e-3 (as tests/engine/test_batch_parts.py)
RUN += ("optim.warmup_steps=0", "optim.name=sgd", "optim.grad_clip=0", "data.prefetch=2")


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


@pytest.mark.long_run
def test_a_run_in_parts_logs_the_whole_batch_run(tiny_cfg, tmp_path):
    """Three steps on 2x1x1, whole batches and in 4 parts (1 micro-batch each): the same
    losses and validation losses step by step, and the final parameters (the run's state)."""
    import jax

    from jaxpod.run.loop import run_training

    results = {}
    for parts in (1, 4):
        logdir = tmp_path / f"parts{parts}"
        cfg = tiny_cfg(*RUN, f"train.batch_parts={parts}", f"train.logdir={logdir}", mesh=(2, 1, 1))
        result = run_training(cfg, quiet=True)
        lines = (logdir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        results[parts] = (result, [r["loss"] for r in records if "loss" in r])
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

"""A run on BPE tokens (`data.tokenizer=bpe`) resumed from a checkpoint continues at the exact
example: the batches its steps read, and their losses, are the uninterrupted run's.

One uninterrupted 4-step run (a checkpoint every 2) on 2x1x1, every training batch it reads
recorded; its record without checkpoint 4 is what a run killed before that commit leaves."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers.texts import write_corpus

pytest.importorskip("tokenizers")

RUN = ("data.name=text-files", "data.tokenizer=bpe", "model.vocab=320", "model.seq_len=16")
RUN += ("train.global_batch=8", "train.grad_accum=null", "train.steps=4", "train.log_every=1")
RUN += ("train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=2")
RUN += ("train.keep_checkpoints=5", "optim.warmup_steps=0")


def test_a_resumed_run_reads_the_uninterrupted_runs_examples(tiny_cfg, tmp_path, monkeypatch):
    import jaxpod.run.loop as loop
    import jaxpod.run.tasks as tasks

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    corpus = write_corpus(tmp_path / "corpus")
    read, reads = tasks.Task.read, []

    def recorded(self, step, val=False, part=0):
        host = read(self, step, val, part)
        if not val:
            reads.append(
                (step, {k: v.copy() for _, _, rows in host.arrays for k, v in rows.items()})
            )
        return host

    monkeypatch.setattr(tasks.Task, "read", recorded)
    compile_step = loop._compile  # reads batch 0 for its shapes: not a step's read
    monkeypatch.setattr(loop, "_compile", lambda *a: (compile_step(*a), reads.clear()))

    def cfg(logdir):
        return tiny_cfg(*RUN, f"data.path={corpus}", f"train.logdir={logdir}", mesh=(2, 1, 1))

    whole = loop.run_training(cfg(tmp_path / "whole"), quiet=True)
    reference, reads[:] = dict(reads), []
    assert sorted(reference) == [0, 1, 2, 3]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = loop.run_training(cfg(tmp_path / "resumed"), quiet=True)
    assert [step for step, _ in reads] == [2, 3]  # steps 3 and 4 read batches 2 and 3
    for step, rows in reads:
        assert rows.keys() == reference[step].keys()
        for key, got in rows.items():
            np.testing.assert_array_equal(got, reference[step][key])
    assert resumed.losses == whole.losses[2:]
    assert not np.array_equal(reference[2][next(iter(rows))], reference[3][next(iter(rows))])

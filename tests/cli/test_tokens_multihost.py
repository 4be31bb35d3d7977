"""BPE tokens (`data.tokenizer=bpe`) on several processes: 2 processes x 2 virtual CPU devices
train the 2x1x2 mesh as 1 process x 4 devices does, on the same token windows; the two
processes, finding no token files, both write them (at once, or the later one finding the
other's) and leave one complete directory.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers.cli import TINY, TINY4, TWO_PROCESSES, finish, start, start_two_processes
from helpers.texts import write_corpus

from jaxpod.run.metrics import read_metrics

pytestmark = [pytest.mark.cli, pytest.mark.xdist_group(TWO_PROCESSES)]
pytest.importorskip("tokenizers")


def test_two_processes_train_on_the_tokens_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # passed on to the runs
    corpus = write_corpus(tmp_path / "corpus")
    data = ("data.name=text-files", f"data.path={corpus}", "data.tokenizer=bpe")
    mesh = ("mesh.replica=2", "mesh.pipeline=1", "mesh.tensor=2")  # each process one replica
    run = ("train", TINY, *TINY4, *data, "model.vocab=320", *mesh)
    finish([start(*run, "devices=4", f"train.logdir={tmp_path / 'one'}")], timeout=300)
    shutil.rmtree(tmp_path / "xdg")  # both processes build the token files
    procs = start_two_processes(*run, "devices=2", f"train.logdir={tmp_path / 'two'}")
    finish(procs, timeout=300)
    (written,) = (tmp_path / "xdg" / "jaxpod" / "tokens").iterdir()  # no temporary left
    files = sorted(p.name for p in written.iterdir())
    assert files == ["meta.json", "tokenizer.json", "train.tokens", "val.tokens"]
    records = {n: read_metrics(tmp_path / n) for n in ("one", "two")}
    for key in ("loss", "val_loss"):
        one, two = ([r[key] for r in records[n] if key in r] for n in ("one", "two"))
        assert len(one) == len(two) > 0
        # the same windows on the same mesh; only the collectives differ (gloo across
        # processes), as tests/cli/test_multihost.py measures for bytes
        np.testing.assert_allclose(two, one, rtol=1e-6, atol=0)

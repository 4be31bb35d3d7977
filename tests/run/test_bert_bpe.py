"""BERT on BPE tokens (`data.tokenizer=bpe`): the BPE trained for it holds `[MASK]` as id 1,
the config masks with that id, and a sharded run (1x2x2: pipeline and tensor) trains as one
device does on the same tokens (two runs: the slow lane)."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest
from helpers.texts import write_corpus

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow

RUN = ("model.name=bert", "data.name=text-files", "data.tokenizer=bpe", "model.vocab=320")
RUN += ("model.seq_len=16", "train.global_batch=8", "train.grad_accum=null", "train.steps=2")
RUN += ("train.log_every=1", "train.eval_every=0", "train.eval_batches=1")
RUN += ("optim.warmup_steps=0", "precision.compute=float32", "precision.params=float32")


def test_bert_trains_on_its_bpe_as_one_device(tiny_cfg, tmp_path, monkeypatch):
    from jaxpod.data.tokens import MASK, load_tokenizer
    from jaxpod.run.loop import run_training

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    corpus = write_corpus(tmp_path / "corpus")
    losses = {}
    for mesh in ((1, 2, 2), (1, 1, 1)):
        cfg = tiny_cfg(
            *RUN, f"data.path={corpus}", f"train.logdir={tmp_path / str(mesh)}", mesh=mesh
        )
        assert cfg.model.mask_id == 1
        losses[mesh] = run_training(cfg, quiet=True).losses
    (saved,) = glob.glob(str(tmp_path / "xdg" / "jaxpod" / "tokens" / "*" / "tokenizer.json"))
    assert load_tokenizer(saved).token_to_id(MASK) == 1
    assert json.loads(open(saved).read())["added_tokens"][1]["content"] == MASK
    assert len(losses[(1, 1, 1)]) == 2 and np.isfinite(losses[(1, 1, 1)]).all()
    np.testing.assert_allclose(losses[(1, 2, 2)], losses[(1, 1, 1)], rtol=2e-6)

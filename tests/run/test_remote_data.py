"""A run on a corpus behind a URL (`data.path=testbucket://...`, `jaxpod.data.store`): the
same losses as the same corpus in a local folder, as bytes and as BPE tokens, and nothing
made where the run starts.

The store is `testbucket://`, an in-memory fsspec filesystem (`helpers.bucket`; no network)."""

from __future__ import annotations

import pytest
from helpers.bucket import upload
from helpers.cli import SMALL
from helpers.texts import write_corpus

URL = "testbucket://bucket/corpus"
RUN = [*SMALL, "train.steps=3", "data.name=text-files", "data.val_fraction=0.2"]


def _train(*overrides: str):
    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.run.loop import run_training

    return run_training(load_config(TINY_YAML, [*RUN, *overrides]), quiet=True)


@pytest.mark.parametrize(
    "tokens",
    [
        ["data.tokenizer=bytes"],
        # the BPE's windows from the store are compared at the data level (fast lane)
        pytest.param(["data.tokenizer=bpe", "model.vocab=320"], marks=pytest.mark.slow),
    ],
)
def test_a_corpus_in_the_store_trains_as_the_local_folder(tmp_path, bucket, tokens):
    local = write_corpus(tmp_path / "corpus")
    upload(bucket, local, URL)
    a = _train(*tokens, f"data.path={local}", f"train.logdir={tmp_path / 'a'}")
    b = _train(*tokens, f"data.path={URL}", f"train.logdir={tmp_path / 'b'}")
    assert a.losses == b.losses and len(a.losses) == 3
    assert {p.name for p in tmp_path.iterdir()} - {"xdg"} == {"a", "b", "corpus"}

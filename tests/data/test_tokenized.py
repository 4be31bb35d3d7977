"""Text as BPE tokens through the config (`jaxpod.data.tokenized`): `data.tokenizer=bpe` or a
tokenizer.json, the token files built once into the user's cache, the windows of a step the
same on every mesh, each replica reading only its rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.texts import documents, write_corpus

from jaxpod.data import tokenized
from jaxpod.data.documents import is_validation
from jaxpod.data.tokenized import check_tokenizer, load_tokens
from jaxpod.data.tokens import load_tokenizer, train_bpe
from jaxpod.errors import DataError

pytest.importorskip("tokenizers")
VF = 0.2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The token cache, moved into the test's directory (`XDG_CACHE_HOME`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "jaxpod" / "tokens"


def bpe_tokens(corpus, tokenizer="bpe", vocab=320, seed=0):
    """`load_tokens` of the corpus at `corpus`: windows of 17 ids, a fifth held out."""
    kw = dict(tokenizer=tokenizer, vocab=vocab, seq_len=16, seed=seed, val_fraction=VF)
    return load_tokens("text-files", path=str(corpus), **kw)


def encoded(tokenizer, held: bool) -> list[int]:
    """The ids of the corpus's train (or held-out) documents in file order, each closed by
    the end-of-text id 0: what the split's token file must hold."""
    docs = [d for d in documents() if is_validation(d, VF) == held]
    return [t for d in docs for t in [*tokenizer.encode(d).ids, 0]]


def test_a_bpe_is_trained_once_into_the_cache(tmp_path, cache, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    ds = bpe_tokens(corpus)
    assert ds.directory.parent == cache
    names = sorted(p.name for p in ds.directory.iterdir())
    assert names == ["meta.json", "tokenizer.json", "train.tokens", "val.tokens"]
    bpe = load_tokenizer(ds.directory / "tokenizer.json")
    assert bpe.get_vocab_size() == 320 and bpe.to_str() == train_bpe(documents(), 320).to_str()
    for split, held in (("train", False), ("val", True)):
        ids = np.fromfile(ds.directory / f"{split}.tokens", dtype=ds.meta["dtype"])
        assert ids.tolist() == encoded(bpe, held)
    monkeypatch.setattr(tokenized, "train_bpe", lambda *a: pytest.fail("trained again"))
    again = bpe_tokens(corpus)
    assert again.directory == ds.directory
    np.testing.assert_array_equal(again.train_rows(7, 0, 8, 8), ds.train_rows(7, 0, 8, 8))
    assert "a BPE trained on it" in ds.describe() and "held-out documents" in ds.describe()


def test_an_edited_corpus_or_another_vocab_gets_its_own_files(tmp_path, cache):
    corpus = write_corpus(tmp_path / "corpus")
    first = bpe_tokens(corpus).directory
    assert bpe_tokens(corpus, vocab=384).directory != first
    (corpus / "doc_000.py").write_text("x = 1\n")
    edited = bpe_tokens(corpus).directory
    assert edited != first and (first / "meta.json").is_file()  # the old files stay whole
    assert json.loads((edited / "meta.json").read_text())["train_docs"] > 0


def test_a_users_tokenizer_json_encodes_the_corpus(tmp_path, cache):
    corpus = write_corpus(tmp_path / "corpus")
    mine = train_bpe(documents(40, seed=1), vocab=300)
    mine.save(str(tmp_path / "mine.json"))
    ds = bpe_tokens(corpus, tokenizer=str(tmp_path / "mine.json"), vocab=304)  # padded table
    assert ds.meta["vocab"] == 300
    ids = np.fromfile(ds.directory / "train.tokens", dtype=ds.meta["dtype"])
    assert ids.tolist() == encoded(mine, held=False)
    check_tokenizer(str(tmp_path / "mine.json"), 300)  # fits exactly


@pytest.mark.parametrize("call", [check_tokenizer, None], ids=["preflight", "loader"])
def test_a_tokenizer_too_large_for_model_vocab_is_one_line(tmp_path, cache, call):
    corpus = write_corpus(tmp_path / "corpus")
    train_bpe(documents(40), vocab=300).save(str(tmp_path / "mine.json"))
    path = str(tmp_path / "mine.json")
    with pytest.raises(DataError) as exc:
        call(path, 256) if call else bpe_tokens(corpus, tokenizer=path, vocab=256)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("model.vocab=256 is smaller than the 300 ids of data.tokenizer=")
    assert msg.endswith("set model.vocab>=300 (rounded up to a multiple of mesh.tensor)")
    assert not cache.exists()  # nothing encoded


def test_one_file_is_one_document_and_is_not_split(tmp_path, cache):
    corpus = write_corpus(tmp_path / "corpus", n=1)
    with pytest.raises(DataError) as exc:
        bpe_tokens(corpus)
    msg = str(exc.value)
    assert "\n" not in msg and "whole documents are held out" in msg and "0 " in msg


def test_a_missing_tokenizer_json_is_one_line(tmp_path, cache):
    corpus = write_corpus(tmp_path / "corpus", n=10)
    with pytest.raises(DataError, match="is no file; name a tokenizer.json") as exc:
        bpe_tokens(corpus, tokenizer=str(tmp_path / "nope.json"))
    assert "\n" not in str(exc.value) and not cache.exists()


MESHES = [(1, 1, 1), (2, 1, 1), (2, 2, 2)]


def test_every_mesh_reads_the_windows_of_the_plain_dataset(tmp_path, cache, tiny_cfg, mesh_for):
    """Train and validation batches of the same (seed, step) on three meshes equal the plain
    dataset's rows; on a mesh with R replicas the dataset is asked for each replica's rows
    once, and for no other rows."""
    import jax

    from jaxpod.run.tasks import build_task

    corpus = write_corpus(tmp_path / "corpus")
    plain = bpe_tokens(corpus, seed=3)
    overrides = ("data.name=text-files", f"data.path={corpus}", "data.tokenizer=bpe")
    overrides += ("model.vocab=320", "model.seq_len=16", "train.seed=3", f"data.val_fraction={VF}")
    overrides += ("train.global_batch=8", "train.grad_accum=null")
    for mesh in MESHES:
        cfg = tiny_cfg(*overrides, mesh=mesh)
        task, _ = build_task(cfg, mesh_for(cfg), initialise=False)
        assert task.dataset.directory == plain.directory
        asked: list = []
        task.dataset = _Spy(task.dataset, asked)
        for step in (0, 9):
            (got,) = task.batch(step)
            np.testing.assert_array_equal(jax.device_get(got), plain.train_rows(step, 0, 8, 8))
        (val,) = task.batch(2, val=True)
        np.testing.assert_array_equal(jax.device_get(val), plain.val_rows(2, 0, 8, 8))
        rows = [(a, b) for _, _, a, b in asked]
        share = 8 // mesh[0]
        assert sorted(set(rows)) == [(r * share, (r + 1) * share) for r in range(mesh[0])]
        assert len(rows) == 3 * mesh[0]  # each replica's rows read once per batch


class _Spy:
    """A dataset whose `read` calls are recorded as (split, step, start, stop)."""

    def __init__(self, dataset, asked: list):
        self._dataset, self._asked = dataset, asked

    def read(self, split, step, start, stop, global_batch):
        self._asked.append((split, step, start, stop))
        return self._dataset.read(split, step, start, stop, global_batch)

    def __getattr__(self, name):
        return getattr(self._dataset, name)

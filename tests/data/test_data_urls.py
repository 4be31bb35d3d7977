"""`data.path` and `data.tokenizer` as URLs (`jaxpod.data.store`): a corpus, a tokenizer.json
and an image folder read through fsspec give what the same files in a local folder give.

The store is `testbucket://`, an in-memory fsspec filesystem (`helpers.bucket`; no network):
a URL read as a local path would find nothing there, or make a `testbucket:` folder in the
working directory. jax-free."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers.bucket import open_bucket, upload
from helpers.texts import write_corpus
from PIL import Image

from jaxpod.data import tokenized
from jaxpod.data.images import load_images
from jaxpod.data.text import load_dataset
from jaxpod.data.tokenized import check_tokenizer, load_tokens
from jaxpod.data.tokens import train_bpe
from jaxpod.errors import UserError

URL = "testbucket://bucket/corpus"
VF = 0.2


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """The store (emptied); the token cache and the working directory in `tmp_path`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    return open_bucket()


def _corpus(tmp_path, fs):
    """The test corpus with a hidden folder and a binary file, local and in the store."""
    local = write_corpus(tmp_path / "corpus")
    (local / ".hidden").mkdir()
    (local / ".hidden" / "skip.py").write_text("hidden = True\n" * 50)
    (local / "blob.bin").write_bytes(b"\0\1\2" * 100)
    return local, upload(fs, local, URL)


def _tokens(path: str, tokenizer: str = "bpe"):
    kw = dict(tokenizer=tokenizer, vocab=320, seq_len=16, seed=0, val_fraction=VF)
    return load_tokens("text-files", path=path, **kw)


def _rows(ds, steps=range(0, 40, 7)) -> list[np.ndarray]:
    return [ds.train_rows(k, 0, 8, 8) for k in steps] + [ds.val_rows(1, 0, 8, 8)]


def test_a_byte_corpus_in_the_store_reads_as_the_local_folder(tmp_path, bucket):
    local, url = _corpus(tmp_path, bucket)
    a = load_dataset("text-files", path=str(local), seq_len=16, seed=3, val_fraction=VF)
    b = load_dataset("text-files", path=url, seq_len=16, seed=3, val_fraction=VF)
    np.testing.assert_array_equal(a._train, b._train)
    np.testing.assert_array_equal(a._val, b._val)
    assert "1 skipped as binary" in b.describe() and url in b.describe()
    capped = load_dataset("text-files", path=url, seq_len=16, seed=3, max_bytes=5000)
    assert "the first 0.0 MiB read" in capped.describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_bpe_tokens_from_the_store_are_those_of_the_local_folder(tmp_path, bucket):
    local, url = _corpus(tmp_path, bucket)
    a, b = _tokens(str(local)), _tokens(url)
    assert a.directory != b.directory  # keyed on the store's stamps, not on the local stat
    for x, y in zip(_rows(a), _rows(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert (a.directory / "tokenizer.json").read_text() == (
        b.directory / "tokenizer.json"
    ).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "xdg"]


def test_an_edited_object_gets_a_new_cache_directory(tmp_path, bucket, monkeypatch):
    """The same store read again finds its token files (no BPE trained); an object rewritten
    with bytes of the same size, or a new object, is a new key."""
    _, url = _corpus(tmp_path, bucket)
    first = _tokens(url).directory
    with monkeypatch.context() as m:
        m.setattr(tokenized, "train_bpe", lambda *a: pytest.fail("trained again"))
        assert _tokens(url).directory == first
    name = f"{url}/doc_005.py"
    text = bucket.cat_file(name)
    bucket.pipe_file(name, text.replace(b"return", b"RETURN"))
    edited = _tokens(url).directory
    bucket.pipe_file(f"{url}/sub/new.py", b"x = 1\n" * 20)
    assert len({first, edited, _tokens(url).directory}) == 3


def test_a_tokenizer_json_in_the_store_is_read_as_the_local_file(tmp_path, bucket):
    """The key hashes the tokenizer's bytes: the same file local or in the store finds the
    same token files."""
    local = write_corpus(tmp_path / "corpus")
    saved = tmp_path / "tokenizer.json"
    saved.write_text(train_bpe((p.read_text() for p in sorted(local.iterdir())), 300).to_str())
    bucket.pipe_file("testbucket://bucket/tok/tokenizer.json", saved.read_bytes())
    check_tokenizer("testbucket://bucket/tok/tokenizer.json", 320)
    a = _tokens(str(local), str(saved))
    b = _tokens(str(local), "testbucket://bucket/tok/tokenizer.json")
    assert a.directory == b.directory and "tokenizer testbucket://" in b.describe()


def _one_line(call, *needles: str) -> str:
    with pytest.raises(UserError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


def test_missing_or_unreadable_urls_are_one_line(tmp_path, bucket, monkeypatch):
    bucket.pipe_file("testbucket://bucket/tok/notes.json", b"not a tokenizer")
    tok = "testbucket://bucket/tok"
    _one_line(lambda: check_tokenizer(f"{tok}/nope.json", 320), "data.tokenizer=", "is no file")
    bad = lambda: check_tokenizer(f"{tok}/notes.json", 320)  # noqa: E731
    _one_line(bad, "is no tokenizer.json")
    _one_line(lambda: _tokens("testbucket://bucket/none"), "data.path=", "does not exist")
    _one_line(lambda: _tokens("nosuchfs://b/c"), "no fsspec filesystem knows nosuchfs://")
    _one_line(lambda: check_tokenizer("s3://b/tokenizer.json", 320), "s3://", "s3fs")
    import fsspec  # noqa: F401 - its registry module, below

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if gcsfs were not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "gs", raising=False)
    _one_line(lambda: _tokens("gs://b/corpus"), "data.path=gs://b/corpus", "gcsfs")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_image_folder_in_the_store_decodes_as_the_local_one(tmp_path, bucket):
    rng = np.random.default_rng(0)
    local = tmp_path / "imgs"
    for i in range(14):
        (local / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(10 + i, 12, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(local / f"c{i % 3}" / f"{i:03d}.png")
    (local / "c0" / ".skip.png").write_bytes(b"hidden, never decoded")
    (local / "c1" / "notes.txt").write_text("not an image")
    url = upload(bucket, local, "testbucket://bucket/imgs")
    kw = dict(image_size=8, seed=1, val_fraction=0.25, workers=2)
    a, b = (
        load_images("image-folder", path=str(local), **kw),
        load_images("image-folder", path=url, **kw),
    )
    assert (a.index.classes, a.train_size, a.val_size) == (
        b.index.classes,
        b.train_size,
        b.val_size,
    )
    for step in range(3):
        for x, y in zip(a.train_batch(step, 0, 4, 4), b.train_batch(step, 0, 4, 4), strict=True):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(a.val_batch(0, 0, 4, 4), b.val_batch(0, 0, 4, 4), strict=True):
        np.testing.assert_array_equal(x, y)
    assert b.peak_bytes > b.index_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]

"""Tests for jaxpod.data.text: byte-level datasets, determinism, slicing invariance, the
held-out split by document, errors."""

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from jaxpod.data import text
from jaxpod.data.documents import is_validation
from jaxpod.data.text import TokenDataset, decode, load_dataset
from jaxpod.errors import DataError

SMALL = 2 * 2**20  # a 2 MiB stdlib corpus keeps most tests fast


def _records(tmp_path, n=100, val_fraction=0.1):
    """A corpus of n one-record files "%07d" (record i in file i): joined by the 2-byte
    separator, window j (seq_len=8) of a split is its j-th document."""
    for i in range(n):
        (tmp_path / f"r{i:03d}.txt").write_bytes(b"%07d" % i)
    return load_dataset(
        "text-files", seq_len=8, seed=0, path=str(tmp_path), val_fraction=val_fraction
    )


def _held(n=100, val_fraction=0.1) -> tuple[list[int], list[int]]:
    """The records of `_records` in whole windows: (train, held out), each in file order (the
    last document of a split lacks the separator that would complete its window)."""
    held = [is_validation(f"{i:07d}", val_fraction) for i in range(n)]
    train = [i for i in range(n) if not held[i]]
    val = [i for i in range(n) if held[i]]
    return train[:-1], val[:-1]


def _ids(rows: np.ndarray) -> list[int]:
    return [int(decode(r)[:7]) for r in rows]


def _partitions(g):
    return [[(0, g)], [(0, 3), (3, g)], [(i, i + 1) for i in range(g)], [(0, 0), (0, 5), (5, g)]]


def _check_slicing(read, g):
    full = read(0, g)
    for parts in _partitions(g):
        np.testing.assert_array_equal(np.concatenate([read(a, b) for a, b in parts]), full)


# ---------------------------------------------------------------- stdlib-code


def test_stdlib_code_loads_real_python():
    ds = load_dataset("stdlib-code", seq_len=128, seed=0)
    assert isinstance(ds, TokenDataset)
    assert ds.num_train_windows * 129 > 2**20
    assert ds.num_val_windows > 0
    rows = ds.train_rows(0, 0, 64, 64)
    assert rows.shape == (64, 129) and rows.dtype == np.int32
    assert rows.min() >= 0 and rows.max() <= 255
    text = "".join(decode(r) for r in rows)
    assert "def " in text or "import" in text
    val = ds.val_rows(0, 0, 16, 16)
    assert val.shape == (16, 129) and val.dtype == np.int32
    line = ds.describe()
    assert "\n" not in line and line.startswith("stdlib-code:") and "129 bytes" in line
    assert "train" in line and "val" in line


def test_stdlib_code_capped_and_cached():
    a = load_dataset("stdlib-code", seq_len=64, seed=0, max_bytes=SMALL)
    b = load_dataset("stdlib-code", seq_len=64, seed=0, max_bytes=SMALL)
    assert (a.num_train_windows + a.num_val_windows) * 65 <= SMALL
    assert a.num_train_windows * 65 > 2**20 * 1.5
    assert text._stdlib_corpus.cache_info().hits >= 1  # the files are read once
    np.testing.assert_array_equal(a.train_rows(3, 0, 8, 8), b.train_rows(3, 0, 8, 8))


def test_stdlib_determinism_and_slicing():
    a = load_dataset("stdlib-code", seq_len=32, seed=1, max_bytes=SMALL)
    b = load_dataset("stdlib-code", seq_len=32, seed=1, max_bytes=SMALL)
    c = load_dataset("stdlib-code", seq_len=32, seed=2, max_bytes=SMALL)
    g = 12
    np.testing.assert_array_equal(a.train_rows(5, 0, g, g), b.train_rows(5, 0, g, g))
    assert not np.array_equal(a.train_rows(5, 0, g, g), c.train_rows(5, 0, g, g))
    assert not np.array_equal(a.train_rows(5, 0, g, g), a.train_rows(6, 0, g, g))
    for step in (0, 7):
        _check_slicing(lambda s, e, st=step: a.train_rows(st, s, e, g), g)
        _check_slicing(lambda s, e, st=step: a.val_rows(st, s, e, g), g)
    # validation is unshuffled and seed-independent
    np.testing.assert_array_equal(a.val_rows(2, 0, g, g), c.val_rows(2, 0, g, g))


def test_too_small_stdlib_names_fix():
    with pytest.raises(DataError, match="model.seq_len") as e:
        load_dataset("stdlib-code", seq_len=4096, seed=0, max_bytes=10_000)
    assert "\n" not in str(e.value)
    assert "data.max_bytes" not in str(e.value)  # no such key: the fix names real ones


# ---------------------------------------------------------------- text-files: order


def test_train_val_split_by_document(tmp_path):
    ds = _records(tmp_path, n=100, val_fraction=0.1)
    train, val = _held()
    assert 0 < len(val) < 20 and len(train) > 70  # about a tenth of the files held out
    assert (ds.num_train_windows, ds.num_val_windows) == (len(train), len(val))
    assert sorted(_ids(ds.train_rows(0, 0, len(train), len(train)))) == train
    assert _ids(ds.val_rows(0, 0, len(val), len(val))) == val  # in file order
    assert not set(train) & set(val)  # no document on both sides
    assert "100 files" in ds.describe()


def test_val_rows_unshuffled_and_wrap(tmp_path):
    ds = _records(tmp_path)
    _, val = _held()
    want = [val[(4 + i) % len(val)] for i in range(4)]  # (j*G+i) % n_val
    assert _ids(ds.val_rows(1, 0, 4, 4)) == want
    _check_slicing(lambda s, e: ds.val_rows(3, s, e, 7), 7)


def test_epochs_visit_every_window_once(tmp_path):
    ds = _records(tmp_path)
    train, _ = _held()
    g, n = 7, len(train)
    steps = (3 * n) // g + 1
    ids = np.concatenate([_ids(ds.train_rows(k, 0, g, g)) for k in range(steps)])
    epochs = [ids[e * n : (e + 1) * n] for e in range(3)]
    for ep in epochs:
        assert sorted(ep.tolist()) == train
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], train)  # shuffled
    # a step straddling an epoch boundary slices consistently
    k = n // g
    _check_slicing(lambda s, e: ds.train_rows(k, s, e, g), g)


def test_order_matches_spec_formula(tmp_path):
    ds = _records(tmp_path)
    train, _ = _held()
    g, n = 5, ds.num_train_windows
    for k in (0, 17, 40):
        idx = k * g + np.arange(g)
        perm = [np.random.default_rng([0, gi // n]).permutation(n) for gi in idx.tolist()]
        want = [train[int(p[gi % n])] for p, gi in zip(perm, idx.tolist(), strict=True)]
        assert _ids(ds.train_rows(k, 0, g, g)) == want


def test_text_files_directory_sorted_and_skips_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zzz" * 400)
    (tmp_path / "a.txt").write_text("aaa" * 400)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 400)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 400)
    ds = load_dataset("text-files", seq_len=15, seed=0, path=str(tmp_path), val_fraction=0.5)
    corpus = np.concatenate([ds._train.ravel(), ds._val.ravel()]).tobytes()
    assert b"aaa" * 5 in corpus and b"zzz" * 5 in corpus
    assert b"\x00" not in corpus and b"\xe9" not in corpus
    assert "2 files" in ds.describe() and "2 skipped" in ds.describe()


# ---------------------------------------------------------------- text-files: errors


def _assert_one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=8, seed=0, path=str(tmp_path / "nope"))
    _assert_one_line(e, "data.path", "does not exist")


def test_path_not_set():
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=8, seed=0)
    _assert_one_line(e, "data.path")


def test_empty_dir(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=8, seed=0, path=str(tmp_path))
    _assert_one_line(e, "data.path", "no UTF-8 text")


def test_only_binary_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "y.dat").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=8, seed=0, path=str(tmp_path))
    _assert_one_line(e, "data.path", "no UTF-8 text")


def test_too_small_corpus(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello world\n" * 20)
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=128, seed=0, path=str(tmp_path))
    _assert_one_line(e, "data.path", "model.seq_len=128", "too few", "add text files")


def test_one_document_is_not_split(tmp_path):
    """A file is a document, held out whole or not at all: one file alone leaves a split
    empty, and the message says why (no window of it is cut off as validation)."""
    (tmp_path / "one.txt").write_text("x" * 10_000)
    with pytest.raises(DataError) as e:
        load_dataset("text-files", seq_len=8, seed=0, path=str(tmp_path), val_fraction=0.2)
    _assert_one_line(e, "whole documents are held out", "data.val_fraction=0.2", "0 ")


# ---------------------------------------------------------------- synthetic


def test_synthetic():
    tracemalloc.start()
    a = load_dataset("synthetic", seq_len=256, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20 and sys.getsizeof(a) < 2**12
    b = load_dataset("synthetic", seq_len=256, seed=0)
    c = load_dataset("synthetic", seq_len=256, seed=1)
    assert a.num_train_windows is None and a.num_val_windows is None
    g = 8
    rows = a.train_rows(10**9, 0, g, g)  # arbitrarily far steps are fine
    assert rows.shape == (g, 257) and rows.dtype == np.int32
    assert rows.min() >= 0 and rows.max() <= 255 and len(np.unique(rows)) > 200
    np.testing.assert_array_equal(rows, b.train_rows(10**9, 0, g, g))
    assert not np.array_equal(rows, c.train_rows(10**9, 0, g, g))
    assert not np.array_equal(a.train_rows(0, 0, g, g), a.train_rows(1, 0, g, g))
    assert not np.array_equal(a.train_rows(0, 0, g, g), a.val_rows(0, 0, g, g))
    _check_slicing(lambda s, e: a.train_rows(3, s, e, g), g)
    _check_slicing(lambda s, e: a.val_rows(3, s, e, g), g)
    assert "synthetic" in a.describe() and "\n" not in a.describe()


# ---------------------------------------------------------------- misc


def test_unknown_name_lists_names():
    with pytest.raises(DataError) as e:
        load_dataset("wikitext", seq_len=8, seed=0)
    _assert_one_line(e, "data.name", "stdlib-code", "text-files", "synthetic")


def test_bad_row_request(tmp_path):
    ds = _records(tmp_path)
    with pytest.raises(ValueError):
        ds.train_rows(0, 3, 9, 8)


def test_decode():
    assert decode(np.array([104, 105, 255], dtype=np.int32)) == "hi\ufffd"


def test_no_jax_import():
    code = "import sys, jaxpod.data.text; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

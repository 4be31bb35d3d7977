"""Corpora larger than what a loader holds: the image-folder loader and the token file reader
hold, by their own accounting (`jaxpod.data.ledger`), their index plus the batches in flight,
however many files or tokens the corpus has."""

import json

import numpy as np
from PIL import Image

from jaxpod.data.image_folder import PIL_PIXEL_BYTES
from jaxpod.data.images import load_images
from jaxpod.data.prefetch import Prefetcher
from jaxpod.data.tokens import META, open_token_files

DEPTH = 2  # batches read ahead; the consumer holds at most 2 more (the one it drops, the next)


def _images(root, n: int, seed: int = 0) -> int:
    """`n` random PNGs of varied sizes (up to 64x64) in 4 classes; returns their RGB bytes."""
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(n):
        w, h = (int(v) for v in rng.integers(8, 65, size=2))
        (root / f"c{i % 4}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"c{i % 4}" / f"{i:04d}.png", compress_level=0)
        total += pixels.nbytes
    return total


def _drain(read, steps: int) -> int:
    """Read `steps` batches through a Prefetcher of DEPTH, as the loop does; rows seen."""
    seen = 0
    with Prefetcher(read, 0, steps, depth=DEPTH) as batches:
        for batch in batches:
            seen += batch[0].shape[0]
    return seen


def test_image_folder_holds_batches_in_flight_not_the_corpus(tmp_path):
    """40 and 400 files, every training image decoded once and more: the peak beyond the
    index is within (DEPTH + 2) batches plus each thread's source image, the same bound for
    both, and ten times below the 400 files' pixels; the index grows with the file count."""
    g, s, workers = 8, 16, 2
    batch = g * s * s * 3 + g * 4  # images and labels
    scratch = workers * 2 * PIL_PIXEL_BYTES * 64 * 64  # a source image and its RGB copy
    bound = (DEPTH + 2) * batch + scratch
    seen = {}
    for n in (40, 400):
        pixels = _images(tmp_path / str(n), n)
        ds = load_images(
            "image-folder", image_size=s, seed=0, path=str(tmp_path / str(n)), workers=workers
        )
        steps = -(-ds.train_size // g) + 1
        assert _drain(lambda k, ds=ds: ds.read("train", k, 0, g, g), steps) >= ds.train_size
        _drain(lambda k, ds=ds: ds.read("val", k, 0, g, g), ds.val_batches(g))
        held_beyond_index = ds.peak_bytes - ds.index_bytes
        assert batch <= held_beyond_index <= bound
        assert ds.ledger.held == ds.index_bytes  # every batch dropped, every count released
        seen[n] = (pixels, ds.index_bytes)
    assert seen[400][0] > 10 * bound  # the corpus decoded would not fit in the bound
    per_file = (seen[400][1] - seen[40][1]) / 360
    assert per_file < 64  # a path, a label, a split row and a visiting position per file


def _token_corpus(directory, windows: int, window: int, seed: int = 0) -> int:
    """Token files of `windows` train windows and a tenth as many val ones (uint16 ids, as
    `write_token_files` writes them); returns the train file's bytes."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    train = rng.integers(0, 50_000, size=windows * window, dtype=np.uint16)
    val = rng.integers(0, 50_000, size=max(1, windows // 10) * window, dtype=np.uint16)
    train.tofile(directory / "train.tokens")
    val.tofile(directory / "val.tokens")
    counts = {"train_docs": 1, "train_ids": train.size, "val_docs": 1, "val_ids": val.size}
    meta = {"vocab": 50_000, "dtype": "uint16", "val_fraction": 0.1} | counts
    (directory / META).write_text(json.dumps(meta))
    return train.nbytes


def test_token_files_hold_batches_in_flight_not_the_corpus(tmp_path):
    """A corpus of 2,000 and 20,000 windows, every window read once: one batch at a time the
    peak beyond the index is the same for both (the batch's copy out of the map and its
    int32 rows), through a Prefetcher within (DEPTH + 2) batches plus one copy; the index is
    one int64 visiting position a window (1/16 of 64 uint16 ids)."""
    seq_len, g = 63, 16
    copy, rows = g * (seq_len + 1) * 2, g * (seq_len + 1) * 4
    one_at_a_time = {}
    for n in (2_000, 20_000):
        corpus = _token_corpus(tmp_path / str(n), n, seq_len + 1)
        ds = open_token_files(tmp_path / str(n), name="gen", seq_len=seq_len, seed=0)
        assert ds.num_train_windows == n and ds.index_bytes == 8 * n
        for step in range(n // g):
            ds.read("train", step, 0, g, g)
        one_at_a_time[n] = ds.peak_bytes - ds.index_bytes
        ahead = open_token_files(tmp_path / str(n), name="gen", seq_len=seq_len, seed=0)
        assert _drain(lambda k, ds=ahead: ds.read("train", k, 0, g, g), n // g) == n // g * g
        assert ahead.peak_bytes - ahead.index_bytes <= (DEPTH + 2) * rows + copy
        assert ahead.ledger.held == ahead.index_bytes
    assert one_at_a_time[2_000] == one_at_a_time[20_000] == copy + rows
    assert corpus > 10 * ahead.peak_bytes  # 20,000 windows: ten times what the reader held

"""The image datasets: determinism, slicing, errors."""

from collections import Counter

import numpy as np
import pytest

from jaxpod.data.images import SYNTHETIC_POOL, ImageDataset, _synthetic_pool, load_images
from jaxpod.errors import DataError


def _digits(image_size=16, seed=0) -> ImageDataset:
    return load_images("digits", image_size=image_size, seed=seed)


def _partitions(g):
    return [[(0, g)], [(0, 3), (3, g)], [(i, i + 1) for i in range(g)], [(0, 0), (0, 5), (5, g)]]


def _check_slicing(read, g):
    """Every partition of rows [0, g) concatenates to the same images and labels."""
    full_x, full_y = read(0, g)
    for parts in _partitions(g):
        xs, ys = zip(*(read(a, b) for a, b in parts), strict=True)
        np.testing.assert_array_equal(np.concatenate(xs), full_x)
        np.testing.assert_array_equal(np.concatenate(ys), full_y)


def _keys(images: np.ndarray) -> list[bytes]:
    return [im.tobytes() for im in images]


# ---------------------------------------------------------------- digits


def test_digits_loads_real_images():
    from sklearn.datasets import load_digits

    ds = _digits(image_size=16)
    assert isinstance(ds, ImageDataset)
    assert ds.num_classes == 10 and ds.image_size == 16
    assert ds.train_size + ds.val_size == 1797 and ds.val_size == 180
    x, y = ds.train_batch(0, 0, 32, 32)
    assert x.shape == (32, 16, 16, 3) and x.dtype == np.uint8
    assert y.shape == (32,) and y.dtype == np.int32 and 0 <= y.min() and y.max() <= 9
    assert x.max() > 200 and x.min() == 0  # scaled to 0..255
    np.testing.assert_array_equal(x[..., 0], x[..., 1])  # grey replicated to RGB
    np.testing.assert_array_equal(x[..., 0], x[..., 2])
    # every image once across the splits: label counts match scikit-learn's
    train_y = ds.train_batch(0, 0, ds.train_size, ds.train_size)[1]
    val_y = ds.val_batch(0, 0, ds.val_size, ds.val_size)[1]
    expect = np.bincount(load_digits().target, minlength=10)
    np.testing.assert_array_equal(np.bincount(train_y, minlength=10) + np.bincount(val_y), expect)
    assert np.bincount(val_y, minlength=10).min() >= 15  # stratified: ~18 per class
    line = ds.describe()
    assert "\n" not in line and line.startswith("digits:") and "1,617 train / 180 val" in line


def test_digits_upscaled_from_8x8():
    from sklearn.datasets import load_digits

    ds = _digits(image_size=8)  # no resize: exactly the scaled scikit-learn pixels
    x, _ = ds.val_batch(0, 0, ds.val_size, ds.val_size)
    raw = np.rint(load_digits().images * 255 / 16).astype(np.uint8)
    raw_keys = set(_keys(raw))
    assert all(k in raw_keys for k in _keys(np.ascontiguousarray(x[..., 0])))


def test_digits_split_depends_on_seed():
    a, b = _digits(seed=0), _digits(seed=1)
    xa = a.val_batch(0, 0, a.val_size, a.val_size)[0]
    xb = b.val_batch(0, 0, b.val_size, b.val_size)[0]
    assert _keys(xa) != _keys(xb)
    again = _digits(seed=0).val_batch(0, 0, a.val_size, a.val_size)[0]
    np.testing.assert_array_equal(again, xa)


def test_train_batch_deterministic_and_sliceable():
    ds = _digits()
    g = 24
    for step in (0, 1, 67, 1000):  # 67 * 24 straddles the end of epoch 0 (1617 images)
        x1, y1 = ds.train_batch(step, 0, g, g)
        x2, y2 = _digits().train_batch(step, 0, g, g)
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
        _check_slicing(lambda a, b, s=step: ds.train_batch(s, a, b, g), g)
    assert _keys(ds.train_batch(0, 0, g, g)[0]) != _keys(ds.train_batch(1, 0, g, g)[0])


def test_train_epochs_are_permutations():
    ds = _digits()
    n = ds.train_size
    e0 = ds.train_batch(0, 0, n, n)[0]
    e1 = ds.train_batch(1, 0, n, n)[0]
    assert Counter(_keys(e0)) == Counter(_keys(e1))
    assert _keys(e0) != _keys(e1)
    # the order depends on the global example index only, not on the batch size
    g = 100
    steps = [ds.train_batch(s, 0, g, g)[0] for s in range(-(-2 * n // g))]
    stream = np.concatenate(steps)[: 2 * n]
    np.testing.assert_array_equal(stream, np.concatenate([e0, e1]))


def test_val_covers_all_val_images_in_order():
    ds = _digits()
    m = ds.val_size  # 180
    everything = ds.val_batch(0, 0, m, m)
    assert len(set(_keys(everything[0]))) > m - 5  # (a few digits may be duplicates)
    g = 64
    assert ds.val_batches(g) == 3 and ds.val_batches(m) == 1 and ds.val_batches(10_000) == 1
    batches = [ds.val_batch(i, 0, g, g) for i in range(ds.val_batches(g))]
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    np.testing.assert_array_equal(x[:m], everything[0])
    np.testing.assert_array_equal(y[:m], everything[1])
    np.testing.assert_array_equal(x[m:], everything[0][: 3 * g - m])  # wraps around
    _check_slicing(lambda a, b: ds.val_batch(1, a, b, g), g)


def test_bad_row_requests():
    ds = _digits()
    for args in [(-1, 0, 4, 4), (0, 0, 5, 4), (0, 3, 2, 4), (0, 0, 0, 0)]:
        with pytest.raises(ValueError, match="bad row request"):
            ds.train_batch(*args)
    with pytest.raises(ValueError, match="bad row request"):
        ds.val_batch(-1, 0, 1, 1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(name="nope"), "data.name='nope' is unknown"),
        (dict(name="digits", image_size=0), "image_size=0"),
        (dict(name="digits", val_fraction=1.0), "data.val_fraction=1.0"),
        (dict(name="digits", num_classes=5), "model.num_classes=5 but digits has 10"),
        (dict(name="image-folder"), "data.path is not set"),
    ],
)
def test_load_errors(kw, match):
    kw = dict(image_size=8, seed=0) | kw
    with pytest.raises(DataError, match=match) as err:
        load_images(kw.pop("name"), **kw)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- synthetic-imagenet


def test_synthetic_imagenet_shapes_and_determinism():
    ds = load_images("synthetic-imagenet", image_size=32, seed=0)
    assert ds.num_classes == 1000 and ds.image_size == 32
    assert ds.train_size > 1_000_000 and ds.val_size == 50_000
    x, y = ds.train_batch(5, 0, 16, 16)
    assert x.shape == (16, 32, 32, 3) and x.dtype == np.uint8
    assert y.shape == (16,) and y.dtype == np.int32 and 0 <= y.min() and y.max() < 1000
    x2, y2 = load_images("synthetic-imagenet", image_size=32, seed=0).train_batch(5, 0, 16, 16)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    _check_slicing(lambda a, b: ds.train_batch(5, a, b, 16), 16)
    _check_slicing(lambda a, b: ds.val_batch(2, a, b, 16), 16)
    other = load_images("synthetic-imagenet", image_size=32, seed=1).train_batch(5, 0, 16, 16)
    assert not np.array_equal(other[1], y)
    assert not np.array_equal(ds.val_batch(5, 0, 16, 16)[1], y)
    assert "\n" not in ds.describe() and ds.describe().startswith("synthetic-imagenet:")


def test_synthetic_imagenet_num_classes_and_cheap_at_380():
    ds = load_images("synthetic-imagenet", image_size=380, seed=0, num_classes=7)
    assert ds.num_classes == 7
    ds.train_batch(0, 0, 1, 1)  # builds the 64-image pool once
    built = _synthetic_pool.cache_info().misses
    x, y = ds.train_batch(10, 0, 32, 32)
    assert _synthetic_pool.cache_info().misses == built  # later batches index the pool
    assert x.shape == (32, 380, 380, 3) and set(y.tolist()) <= set(range(7))
    pool = _synthetic_pool(0, 380)
    assert pool.shape[0] == SYNTHETIC_POOL
    assert all(any(np.array_equal(image, p) for p in pool) for image in x[:4])

"""`image-folder` (`jaxpod.data.image_folder`): indexing, rows, views decoded per batch, errors."""

import numpy as np
import pytest
from PIL import Image  # a dependency of jaxpod (pyproject.toml): missing, this must fail

from jaxpod.data.augment import eval_view
from jaxpod.data.image_folder import FolderImages
from jaxpod.data.images import load_images
from jaxpod.errors import DataError


def _write(path, value, size=(4, 4), mode="RGB", fmt=None):
    """A solid image of `value` (a grey level) at `path`, creating parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = value if mode in ("L", "P") else (value,) * len(mode)
    Image.new(mode, size, colour).save(path, format=fmt)
    return path


def _folder(tmp_path, per_class=(5, 4, 6), size=(4, 4)):
    """Classes c0, c1, ... of solid grey images whose level is a unique id (10 * class + k)."""
    root = tmp_path / "imgs"
    for c, n in enumerate(per_class):
        for k in range(n):
            _write(root / f"c{c}" / f"img{k}.png", 10 * c + k, size)
    return root


def _noise_folder(tmp_path, sizes, seed=0):
    """Random-pixel RGB PNGs of `sizes` ((w, h) each), alternating between two classes."""
    rng = np.random.default_rng(seed)
    root = tmp_path / "noise"
    for i, (w, h) in enumerate(sizes):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"c{i % 2}" / f"{i:03d}.png")
    return root


def _id(image: np.ndarray) -> int:
    return int(image[0, 0, 0])


def _data_error(match_path, **kw) -> str:
    with pytest.raises(DataError) as err:
        load_images("image-folder", image_size=8, seed=0, path=str(match_path), **kw)
    msg = str(err.value)
    assert "\n" not in msg and f"data.path={str(match_path)!r}" in msg
    return msg


def test_every_train_image_once_per_epoch_with_straddling_batches(tmp_path):
    root = str(_folder(tmp_path))
    ds = load_images("image-folder", image_size=4, seed=3, path=root, val_fraction=0.2)
    n, g = ds.train_size, 4  # 15 images: 12 train, 3 val
    assert (n, ds.val_size) == (12, 3)
    val_ids = {_id(x) for x in ds.val_batch(0, 0, 3, 3)[0]}
    stream = np.concatenate([ds.train_batch(s, 0, g, g)[0] for s in range(3 * n // g + 1)])
    ids = [_id(x) for x in stream]
    epochs = [ids[e * n : (e + 1) * n] for e in range(3)]
    all_ids = {10 * c + k for c, m in enumerate((5, 4, 6)) for k in range(m)}
    for epoch in epochs:
        assert sorted(epoch) == sorted(all_ids - val_ids)
    assert epochs[0] != epochs[1]
    g = 5  # 12 is not a multiple of 5: batch 2 straddles epochs 0 and 1
    straddle = [_id(x) for x in ds.train_batch(2, 0, g, g)[0]]
    assert straddle == ids[10:15]


def test_image_folder_happy_path(tmp_path):
    root = tmp_path / "imgs"
    _write(root / "b_cat" / "one.PNG", 10, (6, 6))
    _write(root / "b_cat" / "sub" / "two.jpg", 20, (6, 6))
    _write(root / "a_dog" / "x.bmp", 30, (6, 6))
    _write(root / "a_dog" / "y.gif", 40, (6, 6), mode="L")
    _write(root / "a_dog" / "z.JPEG", 50, (6, 6), fmt="JPEG")
    (root / "a_dog" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    ds = load_images("image-folder", image_size=12, seed=0, path=str(root), val_fraction=0.2)
    assert isinstance(ds, FolderImages)
    assert ds.num_classes == 2 and ds.train_size == 4 and ds.val_size == 1
    x, y = ds.train_batch(0, 0, 4, 4)
    v, vy = ds.val_batch(0, 0, 1, 1)
    assert x.shape == (4, 12, 12, 3) and x.dtype == np.uint8 and y.dtype == np.int32
    got = {(round(float(im.mean()) / 10) * 10, int(label)) for im, label in zip(x, y, strict=True)}
    got.add((round(float(v[0].mean()) / 10) * 10, int(vy[0])))
    assert got == {(30, 0), (40, 0), (50, 0), (10, 1), (20, 1)}  # classes sorted by name
    line = ds.describe()
    assert "\n" not in line and "5 images from" in line and "4 train / 1 val" in line


def test_any_size_and_mode(tmp_path):
    """Sizes from 1x1 to wider and taller than the output, grey, RGBA and palette images:
    every row comes out uint8[S, S, 3]; a grey image's channels are equal."""
    root = tmp_path / "mixed"
    _write(root / "a" / "big.png", 90, (50, 31))
    _write(root / "a" / "tall.png", 80, (3, 40))
    _write(root / "a" / "dot.png", 70, (1, 1))
    _write(root / "b" / "grey.png", 60, (9, 13), mode="L")
    _write(root / "b" / "alpha.png", 50, (17, 17), mode="RGBA")
    _write(root / "b" / "palette.gif", 40, (12, 5), mode="P")
    ds = load_images("image-folder", image_size=16, seed=1, path=str(root), val_fraction=0.2)
    for x, _ in (ds.train_batch(0, 0, 10, 10), ds.val_batch(0, 0, ds.val_size, ds.val_size)):
        assert x.shape[1:] == (16, 16, 3) and x.dtype == np.uint8
    x, y = ds.train_batch(0, 0, ds.train_size, ds.train_size)
    for image in x:
        np.testing.assert_array_equal(image[..., 0], image[..., 1])  # all solid grey levels


def test_val_rows_are_pil_centre_crops(tmp_path):
    """A validation row is the image resized by Pillow, shorter side floor(S / 0.875), and its
    centre S x S: the reference here is written from that rule with Pillow directly."""
    sizes = [(50, 37), (37, 50), (40, 40), (64, 21)]
    root = _noise_folder(tmp_path, sizes)
    s = 24
    ds = load_images("image-folder", image_size=s, seed=0, path=str(root), val_fraction=0.5)
    x, y = ds.val_batch(0, 0, ds.val_size, ds.val_size)
    for image, i in zip(x, ds._val_idx, strict=True):
        with Image.open(root / ds.index.relative(int(i))) as src:
            w, h = src.size
            short = int(s / 0.875)
            nw, nh = (short, short * h // w) if w <= h else (short * w // h, short)
            resized = src.convert("RGB").resize((nw, nh), Image.Resampling.BILINEAR)
            left, top = round((nw - s) / 2), round((nh - s) / 2)
            expect = np.asarray(resized.crop((left, top, left + s, top + s)))
            np.testing.assert_array_equal(image, expect)
            np.testing.assert_array_equal(image, eval_view(src.convert("RGB"), s))


def test_rows_a_function_of_seed_and_step(tmp_path):
    """Same (seed, step): the same pixels from a fresh loader (a resumed run), with 1 or 3
    threads, read whole or in any slices (any mesh); another step or seed: other pixels."""
    sizes = [(20 + 7 * (i % 5), 18 + 5 * (i % 3)) for i in range(12)]
    root = str(_noise_folder(tmp_path, sizes))
    kw = dict(image_size=12, path=root, val_fraction=0.25)
    ds = load_images("image-folder", seed=5, workers=3, **kw)
    g = 6
    first = [ds.train_batch(step, 0, g, g) for step in range(4)]  # 9 train images: 2 epochs
    resumed = load_images("image-folder", seed=5, workers=1, **kw)
    for step in (3, 2):
        np.testing.assert_array_equal(resumed.train_batch(step, 0, g, g)[0], first[step][0])
        np.testing.assert_array_equal(resumed.train_batch(step, 0, g, g)[1], first[step][1])
        for parts in ([(0, 2), (2, 3), (3, 6)], [(i, i + 1) for i in range(g)]):
            sliced = np.concatenate([ds.train_batch(step, a, b, g)[0] for a, b in parts])
            np.testing.assert_array_equal(sliced, first[step][0])
    assert not np.array_equal(first[0][0], first[1][0])
    other_seed = load_images("image-folder", seed=6, **kw)
    assert not np.array_equal(other_seed.train_batch(0, 0, g, g)[0], first[0][0])


def test_image_folder_missing_or_not_a_directory(tmp_path):
    msg = _data_error(tmp_path / "nope")
    assert "does not exist" in msg
    f = tmp_path / "file.png"
    f.write_bytes(b"")
    assert "is not a directory" in _data_error(f)


def test_image_folder_no_class_subdirectories(tmp_path):
    _write(tmp_path / "loose.png", 1)
    assert "no class subdirectories" in _data_error(tmp_path)
    (tmp_path / "empty").mkdir()
    assert "no class subdirectories" in _data_error(tmp_path / "empty")


def test_image_folder_no_images(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "readme.txt").write_text("hi")
    assert "holds no images" in _data_error(tmp_path)


def test_image_folder_empty_class(tmp_path):
    _write(tmp_path / "a" / "1.png", 1)
    (tmp_path / "b").mkdir()
    assert "class directory 'b' holds no images" in _data_error(tmp_path)


def test_image_folder_undecodable_image_named_when_read(tmp_path):
    """Files are opened only when a batch reads them: the read of a broken one fails in one
    line naming it, from a decoding thread or not."""
    _write(tmp_path / "a" / "1.png", 1)
    _write(tmp_path / "a" / "2.png", 2)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (tmp_path / "b" / "text.png").write_text("nor is this a png")
    for workers in (1, 2):
        ds = load_images("image-folder", image_size=8, seed=0, path=str(tmp_path), workers=workers)
        with pytest.raises(DataError) as err:
            ds.train_batch(0, 0, ds.train_size, ds.train_size)  # class b has 1 train image or 2
        msg = str(err.value)
        assert "\n" not in msg and f"data.path={str(tmp_path)!r}" in msg
        named = [f"cannot decode image {f!r}" in msg for f in ("b/broken.jpg", "b/text.png")]
        assert any(named) and msg.endswith("fix or remove the file")


def test_image_folder_wrong_num_classes_too_few_and_workers(tmp_path):
    root = _folder(tmp_path)
    assert "has 3 classes" in _data_error(root, num_classes=4)
    with pytest.raises(DataError, match="data.workers=0 must be >= 1"):
        load_images("image-folder", image_size=8, seed=0, path=str(root), workers=0)
    one = tmp_path / "one"
    _write(one / "a" / "1.png", 1)
    assert "holds 1 image" in _data_error(one)

"""The ImageNet views (`jaxpod.data.augment`): crop boxes, flips and centre crops."""

import math

import numpy as np
import pytest
from PIL import Image

from jaxpod.data.augment import RATIO, SCALE, eval_size, eval_view, random_crop_box, train_view


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (224, 224), (33, 20), (7, 9)])
def test_crop_boxes_in_bounds_and_ranges(size):
    """Over 2000 seeds: every box lies inside the image; a drawn box's area share is in SCALE
    and its aspect in RATIO up to rounding each side to a whole pixel (half a pixel each)."""
    width, height = size
    shares, drawn = [], 0
    for seed in range(2000):
        left, top, w, h = random_crop_box(np.random.default_rng(seed), width, height)
        assert 0 <= left and 0 <= top and 0 < w and 0 < h
        assert left + w <= width and top + h <= height
        if (w, h) == (width, height):
            continue  # the whole image (also the fallback's box for an image within RATIO)
        drawn += 1
        lo_area, hi_area = (w - 0.5) * (h - 0.5), (w + 0.5) * (h + 0.5)
        assert SCALE[0] * width * height <= hi_area and lo_area <= SCALE[1] * width * height
        assert (w - 0.5) / (h + 0.5) <= RATIO[1] and (w + 0.5) / (h - 0.5) >= RATIO[0]
        shares.append(w * h / (width * height))
    if width * height >= 224 * 224:  # large images: the draws spread over the whole range
        assert drawn > 1900 and min(shares) < 0.1 and max(shares) > 0.9


def test_crop_box_fallback_for_extreme_aspect():
    """A 1000x10 strip has no crop within RATIO of area >= 8 %: the centre of the whole
    image clipped to the largest ratio, 4/3 (13x10)."""
    box = random_crop_box(np.random.default_rng(0), 1000, 10)
    assert box == ((1000 - 13) // 2, 0, 13, 10)
    box = random_crop_box(np.random.default_rng(0), 10, 1000)
    assert box == (0, (1000 - 13) // 2, 10, 13)  # 10 / (3/4) = 13.3


def test_train_view_is_the_box_resized_then_maybe_flipped():
    """The view is Pillow's bilinear resize of the drawn box, mirrored left-right when the
    next draw is below 1/2; over 200 seeds both happen, and a mirror differs from the view."""
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 256, size=(37, 50, 3), dtype=np.uint8))
    flips = 0
    for seed in range(200):
        got = train_view(image, 16, np.random.default_rng(seed))
        draws = np.random.default_rng(seed)
        left, top, w, h = random_crop_box(draws, *image.size)
        box = (left, top, left + w, top + h)
        plain = np.asarray(image.resize((16, 16), Image.Resampling.BILINEAR, box=box))
        flip = draws.random() < 0.5
        flips += flip
        np.testing.assert_array_equal(got, plain[:, ::-1] if flip else plain)
        assert got.shape == (16, 16, 3) and got.dtype == np.uint8
    assert 70 < flips < 130
    half = np.zeros((8, 8, 3), np.uint8)
    half[:, 4:] = 255  # left black, right white: a flip puts white on the left
    views = [train_view(Image.fromarray(half), 8, np.random.default_rng(s)) for s in range(40)]
    assert {int(v[:, 0].mean() > v[:, -1].mean()) for v in views} == {0, 1}


@pytest.mark.parametrize("size, out", [((500, 375), 224), ((375, 500), 380), ((300, 300), 64)])
def test_eval_view_centre_of_shorter_side_resize(size, out):
    """The shorter side becomes floor(out / 0.875), the other in proportion, then the centre
    out x out is cut: compared with Pillow's resize and crop computed here."""
    width, height = size
    short = math.floor(out / 0.875)
    assert min(eval_size(width, height, out)) == short
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
    w, h = eval_size(width, height, out)
    assert abs(w / h - width / height) < 1 / short  # proportion kept up to one pixel
    resized = image.resize((w, h), Image.Resampling.BILINEAR)
    left, top = round((w - out) / 2), round((h - out) / 2)
    expect = np.asarray(resized.crop((left, top, left + out, top + out)))
    np.testing.assert_array_equal(eval_view(image, out), expect)

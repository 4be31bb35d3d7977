"""The ImageNet views of one image: a random crop for training, a centre crop for evaluation.

Training (the Inception recipe, as torchvision's `RandomResizedCrop` draws it): a box of
`scale` (0.08, 1) of the image's area and aspect ratio (3/4, 4/3) (drawn log-uniformly), ten
tries, else the whole image clipped to the ratio range; the box resized bilinearly to
`size` x `size`, then flipped left-right with probability 1/2. Evaluation: the shorter side
resized to floor(size / 0.875) (256 for 224), the centre `size` x `size` cut out. Every draw
comes from the `numpy.random.Generator` given, so a view is a function of that generator's
seed. Pillow only; out come uint8[size, size, 3] RGB arrays.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

SCALE = (0.08, 1.0)  # the crop's share of the image's area
RATIO = (3 / 4, 4 / 3)  # the crop's width / height
CROP_FRACTION = 0.875  # evaluation: the centre crop's share of the resized shorter side
TRIES = 10

Box = tuple[int, int, int, int]  # left, top, width, height in source pixels


def random_crop_box(rng: np.random.Generator, width: int, height: int) -> Box:
    """A random crop of a `width` x `height` image: area in `SCALE`, aspect in `RATIO`
    (up to rounding to whole pixels); after `TRIES` misses, the whole image's centre clipped
    to the ratio range."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(TRIES):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    w, h = width, height
    if width / height < RATIO[0]:
        h = max(1, round(w / RATIO[0]))
    elif width / height > RATIO[1]:
        w = max(1, round(h * RATIO[1]))
    return (width - w) // 2, (height - h) // 2, w, h


def train_view(image: Image.Image, size: int, rng: np.random.Generator) -> np.ndarray:
    """`image` (RGB) cropped by `random_crop_box`, resized to `size` x `size` and flipped
    left-right when `rng` says so: uint8[size, size, 3]."""
    left, top, w, h = random_crop_box(rng, *image.size)
    box = (left, top, left + w, top + h)
    out = np.asarray(image.resize((size, size), Image.Resampling.BILINEAR, box=box))
    return out[:, ::-1] if rng.random() < 0.5 else out


def eval_size(width: int, height: int, size: int) -> tuple[int, int]:
    """The size an image is resized to before its centre crop: the shorter side
    floor(size / CROP_FRACTION), the longer in proportion (truncated, as torchvision)."""
    short = math.floor(size / CROP_FRACTION)
    if width <= height:
        return short, max(short, int(short * height / width))
    return max(short, int(short * width / height)), short


def eval_view(image: Image.Image, size: int) -> np.ndarray:
    """`image` (RGB) resized by `eval_size`, its centre `size` x `size`: uint8[size, size, 3]."""
    w, h = eval_size(*image.size, size)
    resized = image.resize((w, h), Image.Resampling.BILINEAR)
    left, top = round((w - size) / 2), round((h - size) / 2)
    return np.asarray(resized.crop((left, top, left + size, top + size)))

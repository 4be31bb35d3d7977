"""Image-classification datasets, deterministic per step and independent of the mesh.

Images stay ``uint8`` on the host, shaped ``[N, H, W, 3]`` (RGB, channels last); the model's
turns them into floats on the device. Row ``i`` of training step ``k`` is global example
``g = k * global_batch + i``; training images are visited in a seeded permutation per epoch
(a global batch may straddle two epochs), so the rows of a step depend only on (dataset,
image_size, seed, global_batch), never on the mesh or the number of processes: every process
reads exactly its own slice and a resumed run sees exactly the rows it would have seen.

Datasets: ``digits`` (scikit-learn's bundled 8x8 handwritten digits, upscaled, held in
memory, no download), ``synthetic-imagenet`` (random images for throughput tests) and
``image-folder`` (a directory with one subdirectory per class, indexed and decoded batch by
batch: `jaxpod.data.image_folder`). Host-side only: numpy + standard library at import
(Pillow and scikit-learn are imported by the loaders that need them), no jax.
`jaxpod.data.prefetch.Prefetcher` reads the next few batches in a background thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from jaxpod.data.text import epoch_positions, global_indices
from jaxpod.errors import DataError

NAMES = ("digits", "synthetic-imagenet", "image-folder")
SYNTHETIC_POOL = 64  # distinct synthetic images; examples pick one by a hash of their index
SYNTHETIC_CLASSES = 1000
SYNTHETIC_TRAIN_SIZE = 1_281_167  # nominal sizes, those of ImageNet-1k
SYNTHETIC_VAL_SIZE = 50_000
_SPLIT_IDS = {"train": 0, "val": 1}
_M64 = (1 << 64) - 1


class ImageBatches:
    """What every image dataset shares: a batch is `(images uint8[G, S, S, 3], labels
    int32[G])`, read by `train_batch` / `val_batch`; validation covers the val set once."""

    image_size: int
    val_size: int
    unit = "images"  # what a step's throughput counts

    def per_example(self) -> int:
        """Units (images) one example trains on: 1."""
        return 1

    def shapes(self, global_batch: int) -> tuple[tuple[int, ...], ...]:
        """The global shape of each batch array: images `(G, H, W, 3)`, labels `(G,)`."""
        s = self.image_size
        return ((global_batch, s, s, 3), (global_batch,))

    def read(self, split: str, step: int, start: int, stop: int, global_batch: int) -> tuple:
        """Rows [start, stop) of train step / val batch `step`: `(images, labels)`."""
        rows = self.train_batch if split == "train" else self.val_batch
        return rows(step, start, stop, global_batch)

    def val_batches(self, global_batch: int) -> int:
        """Full batches of `global_batch` covering every val image once (>= 1).

        The last batch wraps around to the start of the val set when `global_batch` does not
        divide `val_size`, so a few images are counted twice in the average.
        """
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1")
        return max(1, -(-self.val_size // global_batch))


@dataclass(frozen=True)
class ImageDataset(ImageBatches):
    """Labelled uint8 RGB images split into train/val (or synthetic, generated per index).

    `_images` holds every image once (uint8[N, H, W, C], C = 1 for grey images, replicated to
    3 channels per batch); `_train_idx`/`_val_idx` are the rows of each split (int64).
    """

    name: str
    image_size: int
    num_classes: int
    seed: int
    train_size: int
    val_size: int
    _images: np.ndarray | None = field(default=None, repr=False, compare=False)
    _labels: np.ndarray | None = field(default=None, repr=False, compare=False)  # int32[N]
    _train_idx: np.ndarray | None = field(default=None, repr=False, compare=False)
    _val_idx: np.ndarray | None = field(default=None, repr=False, compare=False)
    _source: str = field(default="", repr=False)

    def train_batch(
        self, step: int, start: int, stop: int, global_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of training step `step` (0-based).

        Returns (uint8[stop-start, H, W, 3], int32[stop-start]); each epoch of
        `train_size` consecutive global examples is a seeded permutation of the training set.
        """
        g = global_indices(step, start, stop, global_batch)
        if self._images is None:
            return self._synthetic(g, "train")
        assert self._train_idx is not None
        return self._gather(self._train_idx[epoch_positions(self.seed, self.train_size, g)])

    def val_batch(
        self, index: int, start: int, stop: int, global_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of validation batch `index`, cycling through the val set in order.

        Returns (uint8[stop-start, H, W, 3], int32[stop-start]).
        """
        g = global_indices(index, start, stop, global_batch) % self.val_size
        if self._images is None:
            return self._synthetic(g, "val")
        assert self._val_idx is not None
        return self._gather(self._val_idx[g])

    def describe(self) -> str:
        """One line: source, classes, split sizes and image shape."""
        s = self.image_size
        return (
            f"{self.name}: {self._source}, {self.num_classes} classes, {self.train_size:,} train / "
            f"{self.val_size:,} val images of {s}x{s}x3 uint8"
        )

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels at `rows` (int64[B]): (uint8[B, H, W, 3], int32[B])."""
        assert self._images is not None and self._labels is not None
        images = self._images[rows]
        if images.shape[-1] == 1:
            images = np.repeat(images, 3, axis=-1)
        return images, self._labels[rows]

    def _synthetic(self, g: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Examples g (int64[B]) of `split`: pool image and label from a hash of (seed, split, g).

        The labels carry no information about the images: this data is for throughput only.
        """
        h = _mix(g.astype(np.uint64) ^ np.uint64(_split_key(self.seed, _SPLIT_IDS[split])))
        pool = _synthetic_pool(self.seed, self.image_size)
        images = pool[(h % np.uint64(SYNTHETIC_POOL)).astype(np.int64)]
        labels = ((h >> np.uint64(32)) % np.uint64(self.num_classes)).astype(np.int32)
        return images, labels


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic): uint64[...]."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=16)
def _split_key(seed: int, split: int) -> int:
    """A 64-bit key for (seed, split), mixed into every synthetic example's hash."""
    return int(
        np.random.default_rng([seed % 2**63, split, 0x1A6E]).integers(0, _M64, dtype=np.uint64)
    )


@functools.lru_cache(maxsize=2)
def _synthetic_pool(seed: int, image_size: int) -> np.ndarray:
    """SYNTHETIC_POOL uniformly random images: read-only uint8[64, S, S, 3] (27 MiB at S=380)."""
    rng = np.random.default_rng([seed % 2**63, 2, 0x1A6E])
    pool = rng.integers(0, 256, size=(SYNTHETIC_POOL, image_size, image_size, 3), dtype=np.uint8)
    pool.setflags(write=False)
    return pool


def stratified_split(
    labels: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of rows 0..N-1 keeping class proportions: (train int64[n], val int64[m]).

    m = round(N * val_fraction) clipped to [1, N-1] (N >= 2); both outputs are sorted.
    Each class's rows, in a seeded random order, get keys (rank + 0.5) / class_size; the m
    smallest keys are validation, so every class gives about val_fraction of its images.
    """
    n = labels.shape[0]
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    order = np.random.default_rng([seed % 2**63, 0x5E11]).permutation(n)
    shuffled = labels[order]
    keys = np.empty(n, dtype=np.float64)
    for c in np.unique(shuffled):
        sel = np.flatnonzero(shuffled == c)
        keys[sel] = (np.arange(sel.shape[0]) + 0.5) / sel.shape[0]
    ranked = order[np.argsort(keys, kind="stable")]
    return np.sort(ranked[n_val:]), np.sort(ranked[:n_val])


@functools.lru_cache(maxsize=2)
def _digits(image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 digits, 0..16 -> 0..255, bilinearly resized to image_size.

    Returns read-only (uint8[1797, S, S, 1], int32[1797]); grey, so 1/3 of the RGB memory.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)  # [N, 8, 8]
    out = np.empty((small.shape[0], image_size, image_size, 1), dtype=np.uint8)
    size = (image_size, image_size)
    for i, img in enumerate(small):
        out[i, :, :, 0] = np.asarray(Image.fromarray(img).resize(size, Image.Resampling.BILINEAR))
    labels = bunch.target.astype(np.int32)
    out.setflags(write=False)
    labels.setflags(write=False)
    return out, labels


def one_line(err: BaseException) -> str:
    """An exception's message collapsed onto one line."""
    return " ".join(str(err).split()) or type(err).__name__


def _synthetic_dataset(image_size: int, seed: int, num_classes: int | None) -> ImageDataset:
    """`synthetic-imagenet`: ImageNet-1k's nominal split sizes, images and labels made per
    example (`ImageDataset._synthetic`), so nothing is loaded or held."""
    classes = SYNTHETIC_CLASSES if num_classes is None else num_classes
    source = f"random pixels from a pool of {SYNTHETIC_POOL} images, random labels (seed {seed})"
    return ImageDataset(
        "synthetic-imagenet",
        image_size,
        classes,
        seed,
        SYNTHETIC_TRAIN_SIZE,
        SYNTHETIC_VAL_SIZE,
        _source=source,
    )


def _check_classes(num_classes: int | None, found: int, where: str) -> None:
    """`model.num_classes`, if set, equals the classes the data has."""
    if num_classes is not None and num_classes != found:
        raise DataError(
            f"model.num_classes={num_classes} but {where} has {found} classes; set "
            f"model.num_classes={found} or leave it unset"
        )


def load_images(
    name: str,
    *,
    image_size: int,
    seed: int,
    path: str | None = None,
    val_fraction: float = 0.1,
    num_classes: int | None = None,
    workers: int = 4,
) -> ImageBatches:
    """Load image dataset `name` ('digits', 'synthetic-imagenet' or 'image-folder').

    Images come out as uint8[image_size, image_size, 3]. `num_classes`: for synthetic-imagenet
    the number of label values (default 1000); for the others, if set, it must equal the
    number of classes found. The train/val split is stratified and seeded by `seed`.
    `image-folder` is indexed here and decoded per batch by `workers` threads
    (`jaxpod.data.image_folder`); `digits` is held in memory.
    """
    if name not in NAMES:
        raise DataError(f"data.name={name!r} is unknown; use one of: {', '.join(NAMES)}")
    if image_size < 1:
        raise DataError(f"model.image_size={image_size} must be >= 1; e.g. 224")
    if num_classes is not None and num_classes < 1:
        raise DataError(f"model.num_classes={num_classes} must be >= 1 (or unset)")
    if name == "synthetic-imagenet":
        return _synthetic_dataset(image_size, seed, num_classes)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in (0, 1); e.g. 0.1")
    if name == "image-folder":
        if path is None:
            raise DataError(
                "data.path is not set; data.name='image-folder' needs data.path pointing at a "
                "directory with one subdirectory of images per class"
            )
        from jaxpod.data.image_folder import open_folder

        folder = open_folder(
            path, image_size=image_size, seed=seed, val_fraction=val_fraction, workers=workers
        )
        _check_classes(num_classes, folder.num_classes, f"data.path={path!r}")
        return folder
    images, labels = _digits(image_size)
    _check_classes(num_classes, 10, "digits")
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    source = f"scikit-learn handwritten digits, 8x8 grey upscaled to {image_size}x{image_size}"
    return ImageDataset(
        name,
        image_size,
        10,
        seed,
        int(train_idx.shape[0]),
        int(val_idx.shape[0]),
        _images=images,
        _labels=labels,
        _train_idx=train_idx,
        _val_idx=val_idx,
        _source=source,
    )

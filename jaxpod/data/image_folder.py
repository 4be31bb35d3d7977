"""`image-folder`: a directory of class subdirectories, indexed once, decoded batch by batch.

Loading walks `data.path` and keeps only an index: each image's path relative to it (one
byte array and offsets, sorted by class then path) and its class (the subdirectory, classes
sorted by name); the train/val split is `images.stratified_split` of those labels. No pixel is
read until a batch asks for its rows (under a URL, the prefix is listed through fsspec and an
image's bytes read by `cat_file` when a batch decodes it: `jaxpod.data.store`). A batch
decodes its rows with Pillow in a pool of `data.workers` threads (Pillow releases the GIL
while decoding and resizing), each image of any size and mode converted to RGB, then cut
to `image_size`: a training row by `augment.train_view` (random crop and flip, drawn from a
generator seeded by (seed, global example index), so by (seed, step, row) and never by the
mesh), a validation row by `augment.eval_view` (centre crop). Rows are those of
`ImageDataset`: the same steps, epochs, splits and slices for every mesh and process count,
each process decoding only its own rows, a resumed run the same pixels. The loop's
`Prefetcher` bounds the batches in flight (`data.prefetch`); `FolderImages.ledger` counts
what the loader holds (`jaxpod.data.ledger`).
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxpod.data.images import ImageBatches, one_line, stratified_split
from jaxpod.data.ledger import Ledger
from jaxpod.data.store import filesystem, is_url, stored_files
from jaxpod.data.text import epoch_positions, global_indices
from jaxpod.errors import DataError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif"})
LAYOUT = "data.path/<class>/<image>.jpg"
PIL_PIXEL_BYTES = 4  # Pillow stores an 8-bit RGB, RGBA or P pixel in at most 4 bytes
AUGMENT_KEY = 0xA06  # mixed into every training row's generator seed


def _local_classes(root: Path, path: str) -> dict[str, list[bytes]]:
    """`{class: its image files relative to root}` of the folder `root` (hidden skipped)."""
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DataError(
            f"data.path={path!r} {what}; point data.path at a directory with one "
            "subdirectory of images per class"
        )
    dirs = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    out: dict[str, list[bytes]] = {}
    for c in dirs:
        found: list[bytes] = []
        for dirpath, dirnames, filenames in os.walk(root / c):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, root)
            found += [os.fsencode(os.path.join(rel, f)) for f in filenames if _is_image(f)]
        out[c] = found
    return out


def _stored_classes(path: str) -> dict[str, list[bytes]]:
    """`{class: its image objects relative to the prefix}` of the URL `path` (hidden
    skipped): a class is a first path component under which objects lie."""
    out: dict[str, list[bytes]] = {}
    for f in stored_files(path, "a directory with one subdirectory of images per class"):
        if "/" in f.rel:
            found = out.setdefault(f.rel.split("/", 1)[0], [])
            found += [f.rel.encode()] if _is_image(f.rel) else []
    return out


def _is_image(name: str) -> bool:
    return not Path(name).name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES


class FolderIndex:
    """The images under `root` (a folder, or a URL's prefix read through fsspec): relative
    paths (`names` uint8[total bytes], `offsets` int64[N + 1]), class ids `labels` int32[N]
    and the class names; nothing decoded."""

    def __init__(self, path: str):
        self.path = path  # as the user wrote it, for messages
        self.fs = None
        if is_url(path):
            self.fs, root = filesystem("data.path", path)
            self.root: Path | str = root.rstrip("/")
            by_class = _stored_classes(path)
        else:
            self.root = Path(path).expanduser()
            by_class = _local_classes(self.root, path)
        dirs = sorted(by_class)
        if not dirs:
            raise DataError(
                f"data.path={path!r} has no class subdirectories; put each class's images in "
                f"its own subdirectory ({LAYOUT})"
            )
        names, counts = bytearray(), []
        lengths: list[int] = []
        sep = b"/" if self.fs is not None else os.fsencode(os.sep)
        for c in dirs:
            files = sorted(by_class[c], key=lambda f: f.split(sep))
            counts.append(len(files))
            lengths += map(len, files)
            names += b"".join(files)
        self._check(dirs, counts)
        self.classes = tuple(dirs)
        self.names = np.frombuffer(bytes(names), dtype=np.uint8)
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.labels = np.repeat(np.arange(len(dirs), dtype=np.int32), counts)

    def source(self, rel: str) -> tuple[Path | io.BytesIO, int]:
        """What Pillow opens for image `rel`, and the bytes read to make it: the local file
        (0), or the object's bytes read through the filesystem (their size)."""
        if self.fs is None:
            return self.root / rel, 0
        data = self.fs.cat_file(f"{self.root}/{rel}")
        return io.BytesIO(data), len(data)

    def _check(self, dirs: list[str], counts: list[int]) -> None:
        """Every class holds an image, and there are two (one train, one val)."""
        exts = "/".join(sorted(s[1:] for s in IMAGE_SUFFIXES))
        if not any(counts):
            raise DataError(
                f"data.path={self.path!r} holds no images ({exts}) in its {len(dirs)} class "
                f"subdirectories; add images as {LAYOUT}"
            )
        for c, n in zip(dirs, counts, strict=True):
            if n == 0:
                raise DataError(
                    f"data.path={self.path!r}: class directory {c!r} holds no images ({exts}); "
                    "add images to it or remove it"
                )
        if sum(counts) < 2:
            raise DataError(
                f"data.path={self.path!r} holds 1 image; need at least 2 (1 train + 1 val): "
                "add images"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def relative(self, i: int) -> str:
        """Image `i`'s path relative to the root, '/'-separated."""
        raw = self.names[self.offsets[i] : self.offsets[i + 1]].tobytes()
        return Path(os.fsdecode(raw)).as_posix()

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays."""
        return self.names.nbytes + self.offsets.nbytes + self.labels.nbytes


class FolderImages(ImageBatches):
    """The images of a `FolderIndex`, split, decoded per batch (see the module docstring).

    `ledger` counts the bytes the loader holds: the index (`index_bytes`: paths, labels,
    split rows and one epoch's visiting order), the batches it returned while they are alive,
    and each decoding thread's source image and its RGB copy (`PIL_PIXEL_BYTES` a pixel).
    """

    name = "image-folder"

    def __init__(
        self, index: FolderIndex, *, image_size: int, seed: int, val_fraction: float, workers: int
    ):
        if workers < 1:
            raise DataError(f"data.workers={workers} must be >= 1; e.g. 4")
        self.index, self.image_size, self.seed, self.workers = index, image_size, seed, workers
        self.num_classes = len(index.classes)
        self._train_idx, self._val_idx = stratified_split(index.labels, val_fraction, seed)
        self.train_size, self.val_size = len(self._train_idx), len(self._val_idx)
        order = 8 * self.train_size  # epoch_permutation's int64 visiting order
        split = self._train_idx.nbytes + self._val_idx.nbytes
        self.index_bytes = index.nbytes + split + order
        self.ledger = Ledger(self.index_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def peak_bytes(self) -> int:
        """The most bytes the loader has held at once (index included)."""
        return self.ledger.peak

    def train_batch(
        self, step: int, start: int, stop: int, global_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of training step `step`, random views: (uint8[B, S, S, 3],
        int32[B]); each epoch visits the training images in a permutation seeded by
        (seed, epoch)."""
        g = global_indices(step, start, stop, global_batch)
        files = self._train_idx[epoch_positions(self.seed, self.train_size, g)]
        return self._decode(files, g)

    def val_batch(
        self, index: int, start: int, stop: int, global_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of validation batch `index`, centre crops of the val images in
        order (wrapping around): (uint8[B, S, S, 3], int32[B])."""
        g = global_indices(index, start, stop, global_batch) % self.val_size
        return self._decode(self._val_idx[g], None)

    def describe(self) -> str:
        """One line: source, classes, split sizes, how rows are made."""
        s = self.image_size
        return (
            f"{self.name}: {len(self.index):,} images from {self.index.path}, {self.num_classes} "
            f"classes, {self.train_size:,} train / {self.val_size:,} val, decoded per batch by "
            f"{self.workers} threads to {s}x{s}x3 uint8 (train: random crop and flip; val: "
            "centre crop)"
        )

    def _decode(self, files: np.ndarray, g: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Images `files` (int64[B]) as training views seeded by `g` (int64[B]), or as
        centre crops (`g` None), decoded in the pool: (uint8[B, S, S, 3], int32[B])."""
        s = self.image_size
        images = self.ledger.track(np.empty((files.shape[0], s, s, 3), np.uint8))
        labels = self.ledger.track(self.index.labels[files])

        def row(r: int) -> None:
            images[r] = self._view(int(files[r]), None if g is None else int(g[r]))

        if self.workers == 1 or files.shape[0] <= 1:
            for r in range(files.shape[0]):
                row(r)
        else:
            list(self._executor().map(row, range(files.shape[0])))
        return images, labels

    def _view(self, i: int, g: int | None) -> np.ndarray:
        """Image `i` decoded, as RGB, and cut to size (`augment`): uint8[S, S, 3]."""
        from PIL import Image

        from jaxpod.data.augment import eval_view, train_view

        rel = self.index.relative(i)
        try:
            source, read = self.index.source(rel)
            with Image.open(source) as img:
                w, h = img.size
                with self.ledger.scratch(read + 2 * PIL_PIXEL_BYTES * w * h):
                    rgb = img.convert("RGB")  # loads (GIFs: the first frame)
                    if g is None:
                        return eval_view(rgb, self.image_size)
                    rng = np.random.default_rng([self.seed % 2**63, AUGMENT_KEY, g])
                    return train_view(rgb, self.image_size, rng)
        except Exception as e:  # Pillow raises OSError, ValueError, SyntaxError, ...
            raise DataError(
                f"data.path={self.index.path!r}: cannot decode image {rel!r} ({one_line(e)}); "
                "fix or remove the file"
            ) from e

    def _executor(self) -> ThreadPoolExecutor:
        """The decoding threads, started on first use."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="jaxpod-decode")
            return self._pool


def open_folder(
    path: str, *, image_size: int, seed: int, val_fraction: float, workers: int = 4
) -> FolderImages:
    """The `image-folder` dataset at `path`: indexed now, decoded per batch."""
    index = FolderIndex(path)
    return FolderImages(
        index, image_size=image_size, seed=seed, val_fraction=val_fraction, workers=workers
    )
